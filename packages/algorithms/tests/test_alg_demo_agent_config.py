"""The agent demo's cheap parts (the demo itself runs in ``nox -s demo_agent``, ~15-30 min): its data
splits, its GRPO config, and the CLI's ``--seed``."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms import cli
from shardforge.algorithms.config_io import build_config, load_yaml
from shardforge.algorithms.demos import demo_agent
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
    assert cli.main(["demo-agent", "--out", str(tmp_path), "--seed", "3", "--grpo-steps", "5"]) == 0
    assert seen == {"out": str(tmp_path), "nproc": 2, "grpo_steps": 5, "seed": 3}
