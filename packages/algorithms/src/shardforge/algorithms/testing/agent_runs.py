"""Shared pieces of the agent-workflow tests (``workflow.name: agent | verifiers``): the tiny chat model with
Qwen3's tool template and doubling prompts, a short single-process GRPO run, and its train records."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["agent_chat_assets", "run_agent_grpo", "train_records"]


def agent_chat_assets(root: Path, module_name: str, module_text: str) -> dict[str, Any]:
    """The tiny chat model under ``root``, ``module_text`` importable as ``module_name``, and 8 ``a+a=`` prompts."""
    from shardforge.algorithms.testing import QWEN3_TOOL_TEMPLATE, tiny_chat_assets

    (root / f"{module_name}.py").write_text(module_text)
    sys.path.insert(0, str(root))
    assets = tiny_chat_assets(root, seed=3, chat_template=QWEN3_TOOL_TEMPLATE)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "completion": str(2 * a)}) + "\n" for a in range(8)))
    return assets | {"data": str(data)}


def run_agent_grpo(chat: dict[str, Any], out: Path, workflow: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """2 GRPO steps of 2 prompts x 2 episodes on 1 process with ``workflow``; ``overrides`` as ``key=value``."""
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    base = {
        "model": chat["model"], "train_file": chat["data"], "output_dir": str(out), "layout": "d1", "steps": 2,
        "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6, "progress": False, "export_hf_at_end": False,
        "temperature": 1.0, "reward_fn": "exact_match", "workflow": workflow,
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    return run_grpo(build_config(GRPOConfig, apply_overrides(base, [f"{k}={v}" for k, v in overrides.items()])))


def train_records(out: Path) -> list[dict[str, Any]]:
    """The run's ``split: train`` rows of metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]
