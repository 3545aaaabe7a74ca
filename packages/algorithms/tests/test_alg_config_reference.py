"""docs/configuration.md is generated from the config dataclasses and kept current (issue 37): every key of every
trainer and of ``shardforge eval`` is on the page with its docstring, and the check fails on a stale page or a field
without a docstring."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from shardforge.algorithms.cli import config_reference
from shardforge.algorithms.cli.config_reference import (
    check_reference,
    commands,
    render_reference,
    section_paths,
    undocumented_fields,
)

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def _keys_by_heading(page: str) -> dict[str, list[str]]:
    """``{heading: [key, ...]}``: the first column of the table under each ``##``/``###`` heading."""
    out: dict[str, list[str]] = {}
    heading = ""
    for line in page.splitlines():
        if line.startswith("#"):
            heading = line
            assert heading not in out, f"heading {heading!r} twice: two sections share a class name"
            out[heading] = []
        elif match := re.match(r"\| `([^`]+)` \|", line):
            out[heading].append(match.group(1))
    return out


def test_the_committed_page_is_current() -> None:
    if not PAGE.parent.is_dir():
        pytest.skip("no docs/ next to the package (an installed wheel): the page lives in the repository")
    assert check_reference(PAGE) == [], "run `shardforge config-reference` and commit docs/configuration.md"


def test_every_field_of_every_command_and_section_is_documented_on_the_page() -> None:
    assert undocumented_fields() == []
    page = render_reference()
    tables = _keys_by_heading(page)
    for command, cls in commands().items():
        assert tables[f"## `shardforge {command}`"] == [f.name for f in dataclasses.fields(cls)], command
    sections = section_paths()
    for cls in sections:
        assert tables[f"### {cls.__name__}"] == [f.name for f in dataclasses.fields(cls)], cls
    for nested in ("RolloutConfig", "VLLMOptions", "EngineConfig", "OptimizerConfig", "WorkflowConfig"):
        assert f"### {nested}" in tables
    by_name = {cls.__name__: keys for cls, keys in sections.items()}
    assert by_name["VLLMOptions"] == ["rollout.vllm"]
    assert by_name["OptimizerConfig"] == ["critic_engine.optimizer", "engine.optimizer"]
    assert by_name["RewardTermConfig"] == ["rewards[]"]
    anchors = {heading.lstrip("#").strip().strip("`").lower() for heading in tables}
    for target in re.findall(r"\]\(#([^)]+)\)", page):
        assert target in anchors, f"link to #{target} has no heading"


def test_types_and_defaults_read_as_yaml() -> None:
    page = render_reference()
    assert "| `loggers` | list of str | `[jsonl, tensorboard]` |" in page
    assert "| 'off' \\| 'async' \\| 'async_pinned' | `'off'` |" in page  # YAML 1.1 reads a bare off as false
    assert "| `lora` | [LoRAConfig](#loraconfig) \\| null | `null` |" in page
    assert "| `model` | str | **required** |" in page
    # eval's sampling section starts from other defaults than the RL trainers': the row says which
    eval_row = next(line for line in page.split("## `shardforge eval`")[1].splitlines() if "`eval_sampling`" in line)
    assert "(section), with `samples: 4`, `pass_k: [1, 4]`" in eval_row


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Base:
    inherited: int = 0
    """Declared (and documented) by the base."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Nested:
    bare_nested: str = "x"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Planted(_Base):
    documented: int = 1
    """Has one."""
    bare: int = 2
    nested: _Nested = dataclasses.field(default_factory=_Nested)
    """A section whose field has no docstring."""


def test_a_field_without_a_docstring_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_reference, "commands", lambda: {"train planted": _Planted})
    assert undocumented_fields() == ["_Nested.bare_nested", "_Planted.bare"]
    page = tmp_path / "configuration.md"
    page.write_text(render_reference())
    assert "| `inherited` | int | `0` | Declared (and documented) by the base. |" in page.read_text()
    assert check_reference(page) == [
        "config field _Nested.bare_nested has no docstring",
        "config field _Planted.bare has no docstring",
    ]


def test_the_cli_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    from shardforge.algorithms.cli.main import main

    page = tmp_path / "configuration.md"
    assert main(["config-reference", "--out", str(page), "--check"]) == 1  # missing
    assert main(["config-reference", "--out", str(page)]) == 0
    assert main(["config-reference", "--out", str(page), "--check"]) == 0
    page.write_text(page.read_text().replace("| `steps` |", "| `stepz` |", 1))
    assert main(["config-reference", "--out", str(page), "--check"]) == 1
