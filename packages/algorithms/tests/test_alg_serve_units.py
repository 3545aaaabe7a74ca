"""`shardforge serve`'s parts that need no SDK: API keys, config limits, the CLI's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardforge.algorithms.cli.main import main
from shardforge.algorithms.serve.config import ServeConfig
from shardforge.algorithms.serve.tenants import TenantKeys, generate_key


def test_keys_name_tenants_and_must_start_with_tml(tmp_path: Path) -> None:
    file = tmp_path / "keys.json"
    file.write_text(json.dumps({"bob": "tml-bob-0123456789"}))
    keys = TenantKeys.parse(["alice=tml-alice-0123456789"], file)
    assert keys.tenant("tml-alice-0123456789") == "alice" and keys.tenant("tml-bob-0123456789") == "bob"
    assert keys.tenant("tml-nobody-01234567") is None and keys.tenant(None) is None
    assert keys.tenants == ["alice", "bob"]
    assert generate_key().startswith("tml-")
    with pytest.raises(ValueError, match="must start with 'tml-'"):
        TenantKeys({"sk-0123456789abcdef": "eve"})
    with pytest.raises(ValueError, match="TENANT=tml-"):
        TenantKeys.parse(["tml-no-tenant-0123"])
    with pytest.raises(ValueError, match="no API keys"):
        TenantKeys({})


def test_config_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        ServeConfig(model_dir="m", max_tokens=0)


def test_cli_refuses_a_missing_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "missing")]) != 0
    assert "is not a directory" in capsys.readouterr().err
