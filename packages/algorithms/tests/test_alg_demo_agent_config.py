"""The agent demo's cheap parts (the demo itself runs in ``nox -s demo_agent``, ~15-30 min): its data
splits, its GRPO config, its SFT stop rule (on made-up success curves), and the CLI's options."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.cli import main as cli
from shardforge.algorithms.config_io import build_config, load_yaml
from shardforge.algorithms.demos import demo_agent
from shardforge.algorithms.demos.agent_sft_stop import SFTStopResult, SFTStopRule, train_until_success
from shardforge.algorithms.demos.demo_agent import make_tool_data
from shardforge.algorithms.trainers.grpo import GRPOConfig

DEMOS = Path(demo_agent.__file__).parent


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tool_data_splits_are_disjoint_and_traces_answer_with_the_tool_result(tmp_path: Path) -> None:
    files = make_tool_data(tmp_path, num_sft=20, num_eval=30, num_rl=40, seed=3)
    sft, train, held_out = (_rows(files[name]) for name in ("sft", "train", "eval"))
    assert (len(sft), len(train), len(held_out)) == (20, 40, 30)
    sft_prompts = {row["messages"][0]["content"] for row in sft}
    train_prompts, eval_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in held_out}
    assert len(sft_prompts | train_prompts | eval_prompts) == 90  # no pair in two splits
    for row in sft:
        a, b = map(int, row["messages"][0]["content"].rstrip("=").split("+"))
        _user, call, tool, answer = row["messages"]
        assert call["tool_calls"][0]["function"]["arguments"] == {"expression": f"{a}+{b}"}
        assert tool["content"] == answer["content"] == str(a + b)
    for row in train + held_out:
        a, b = map(int, row["prompt"].rstrip("=").split("+"))
        assert row["completion"] == str(a + b)


def test_demo_grpo_config_evaluates_every_held_out_prompt() -> None:
    data = load_yaml(DEMOS / "demo_agent_grpo.yaml") | {"model": "m", "train_file": "t.jsonl", "output_dir": "o"}
    config = build_config(GRPOConfig, data)
    held_out = inspect.signature(demo_agent.run_agent_demo).parameters["held_out"].default
    assert config.eval_size == held_out
    assert config.workflow.name == "tool_use" and config.reward_fn == "exact_match"
    assert config.engine.scheduler.warmup_steps < config.steps


def test_cli_passes_the_seed_to_the_demo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(demo_agent, "run_agent_demo", lambda out, **kwargs: seen.update(out=out, **kwargs))
    argv = ["demo-agent", "--out", str(tmp_path), "--seed", "3", "--grpo-steps", "5", "--sft-stop", "target=0.3"]
    assert cli.main(argv) == 0
    rule = demo_agent.load_sft_stop_rule(["target=0.3"])
    expected = {"nproc": 2, "sft_steps": None, "sft_stop": rule, "grpo_steps": 5, "seed": 3, "sft_only": False}
    assert seen == {"out": str(tmp_path)} | expected | {"openai_agent": False}
    assert cli.main([*argv, "--openai-agent"]) == 0
    assert seen["openai_agent"] is True


def test_openai_agent_variant_runs_an_sdk_only_agent_with_the_demo_settings() -> None:
    """``--openai-agent``: GRPO's settings stay the demo's, the workflow becomes the agent file, and that file
    imports the openai SDK and no shardforge module (what the demo shows)."""
    from shardforge.algorithms.config_io import apply_overrides
    from shardforge.core.registry import import_path

    base = load_yaml(DEMOS / "demo_agent_grpo.yaml") | {"model": "m", "train_file": "t.jsonl", "output_dir": "o"}
    config = build_config(GRPOConfig, apply_overrides(base, demo_agent.OPENAI_AGENT_OVERRIDES))
    tool_use = build_config(GRPOConfig, base)
    assert config.workflow.name == "agent" and config.workflow.max_failed_fraction == 0.25
    same = ("steps", "temperature", "max_new_tokens", "prompts_per_step", "group_size")
    assert [getattr(config, key) for key in same] == [getattr(tool_use, key) for key in same]
    pytest.importorskip("openai")  # the agent imports it (shardforge-rollout[openai])
    assert inspect.iscoroutinefunction(import_path(config.workflow.agent.run))
    source = (DEMOS / "openai_calculator_agent.py").read_text()
    imports = re.findall(r"^(?:import|from) (\S+)", source, flags=re.M)
    assert "openai" in imports and not [name for name in imports if name.startswith("shardforge")]


def _run_rule(rule: SFTStopRule, curve: dict[int, float]) -> tuple[SFTStopResult, list[int]]:
    """The stop rule on a made-up success curve (step -> validation success); also the steps trained to."""
    trained: list[int] = []
    result = train_until_success(rule, trained.append, lambda step: curve[step])
    return result, trained


def test_sft_stop_rule_stops_at_the_first_check_at_or_above_target() -> None:
    rule = SFTStopRule(target=0.2, high=0.5, first_check=60, check_every=20, max_steps=130)
    assert rule.check_steps() == [60, 80, 100, 120, 130]
    curve = {60: 0.0, 80: 0.05, 100: 0.2, 120: 0.9, 130: 0.95}
    result, trained = _run_rule(rule, curve)
    assert (result.steps, result.success, result.reason) == (100, 0.2, "target")  # >= target stops
    assert trained == [60, 80, 100] and result.checks == [(60, 0.0), (80, 0.05), (100, 0.2)]
    result, _ = _run_rule(rule, curve | {100: 0.1})
    assert (result.steps, result.reason) == (120, "overshoot")  # past high: stops, reported
    result, trained = _run_rule(rule, dict.fromkeys(curve, 0.01))
    assert (result.steps, result.success, result.reason) == (130, 0.01, "max_steps") and trained[-1] == 130


def test_sft_stop_rule_goes_back_after_an_overshoot_and_checks_finer() -> None:
    rule = SFTStopRule(target=0.2, high=0.5, first_check=60, check_every=20, fine_every=5, max_steps=300)
    curve = {60: 0.0, 80: 0.12, 85: 0.15, 90: 0.3, 95: 0.6, 100: 0.8}
    trained: list[int] = []
    rewinds: list[int] = []
    result = train_until_success(rule, trained.append, lambda step: curve[step], rewinds.append)
    assert rewinds == [80] and trained == [60, 80, 100, 85, 90]  # back to 80's checkpoint, then 5 apart
    assert (result.steps, result.success, result.reason) == (90, 0.3, "target")
    curve |= {90: 0.55, 95: 0.7}
    trained, rewinds = [], []
    result = train_until_success(rule, trained.append, lambda step: curve[step], rewinds.append)
    assert rewinds == [80] and trained == [60, 80, 100, 85, 90]  # still above high: overshoot
    assert (result.steps, result.reason) == (90, "overshoot")
    # the retrained steps may differ (not bit-exact): all below target again, then a second overshoot
    trained, rewinds, values = [], [], iter([0.0, 0.12, 0.8, 0.1, 0.1, 0.1, 0.1, 0.9])
    result = train_until_success(rule, trained.append, lambda step: next(values), rewinds.append)
    assert rewinds == [80] and trained == [60, 80, 100, 85, 90, 95, 100, 120]  # goes back once only
    assert (result.steps, result.success, result.reason) == (120, 0.9, "overshoot")
    rewinds.clear()
    result = train_until_success(rule, list[int]().append, lambda step: {60: 0.9}[step], rewinds.append)
    assert (result.steps, result.reason, rewinds) == (60, "overshoot", [])  # no earlier check to go back to


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("target", 0.0, "target=0.0 is invalid"),
        ("target", 1.5, "target=1.5 is invalid"),
        ("high", 0.1, "high=0.1 is invalid"),
        ("check_every", 0, "check_every=0 is invalid"),
        ("fine_every", 25, "fine_every=25 is invalid; use 1 <= fine_every <= check_every=20"),
        ("val_prompts", 0, "val_prompts=0 is invalid"),
        ("max_steps", 10, "max_steps=10 is invalid; it must be >= first_check=60"),
    ],
)
def test_sft_stop_rule_rejects_bad_settings(key: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SFTStopRule(**{key: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"valid keys: .*check_every"):
        demo_agent.load_sft_stop_rule(["targt=0.3"])
    assert demo_agent.load_sft_stop_rule(["target=0.3"]).target == 0.3  # the YAML + an override


def test_validation_split_is_disjoint_and_leaves_the_other_splits_unchanged(tmp_path: Path) -> None:
    before = make_tool_data(tmp_path / "a", num_sft=20, num_eval=30, num_rl=40, seed=3)
    after = make_tool_data(tmp_path / "b", num_sft=20, num_eval=30, num_rl=40, seed=3, num_val=25)
    for name in ("sft", "train", "eval"):
        assert after[name].read_text() == before[name].read_text()
    val = {row["prompt"] for row in _rows(after["val"])}
    others = {r["prompt"] for r in _rows(after["train"]) + _rows(after["eval"])}
    others |= {r["messages"][0]["content"] for r in _rows(after["sft"])}
    assert len(val) == 25 and not val & others
