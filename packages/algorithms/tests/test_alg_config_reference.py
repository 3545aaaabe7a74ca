"""docs/configuration.md is generated from the config dataclasses and kept current (issue 37): every key of every
trainer and of ``shardforge eval`` is on the page with its docstring, and the check fails on a stale page or a field
without a docstring."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shardforge.algorithms.cli import config_reference
from shardforge.algorithms.cli.config_reference import check_reference, commands, render_reference

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_the_committed_page_is_current() -> None:
    if not PAGE.parent.is_dir():
        pytest.skip("no docs/ next to the package (an installed wheel): the page lives in the repository")
    assert check_reference(PAGE) == [], "run `shardforge config-reference` and commit docs/configuration.md"


def test_every_key_of_every_command_is_on_the_page() -> None:
    page = render_reference()
    for command, cls in commands().items():
        assert f"## `shardforge {command}`" in page
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in page, (command, field.name)
    for nested in ("### RolloutConfig", "### VLLMOptions", "### EngineConfig", "### WorkflowConfig"):
        assert nested in page
    assert "[RolloutConfig](#rolloutconfig)" in page and "[VLLMOptions](#vllmoptions)" in page


def test_a_field_without_a_docstring_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Planted:
        documented: int = 1
        """Has one."""
        bare: int = 2

    monkeypatch.setattr(config_reference, "commands", lambda: {"train planted": Planted})
    assert config_reference.undocumented_fields() == ["Planted.bare"]
    page = tmp_path / "configuration.md"
    page.write_text(render_reference())
    assert check_reference(page) == ["config field Planted.bare has no docstring"]


def test_the_cli_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    from shardforge.algorithms.cli.main import main

    page = tmp_path / "configuration.md"
    assert main(["config-reference", "--out", str(page), "--check"]) == 1  # missing
    assert main(["config-reference", "--out", str(page)]) == 0
    assert main(["config-reference", "--out", str(page), "--check"]) == 0
    page.write_text(page.read_text().replace("| `steps` |", "| `stepz` |", 1))
    assert main(["config-reference", "--out", str(page), "--check"]) == 1
