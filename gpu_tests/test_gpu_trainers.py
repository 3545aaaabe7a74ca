"""The trainers at world 1 on CUDA under a 1-rank NCCL group, every collective recorded.

SFT, GRPO with the embedded HF rollout engine (on the GPU), PPO with a critic and a reference model
kept on the host between uses (`offload_when_idle`). Each run: no collective tensor on the wrong
device (`CollectiveRecorder`, rule 2 under NCCL), a finite loss, and for GRPO the trainer-vs-rollout
log-prob gap (``behaviour_kl``: mean |trainer log-prob - rollout log-prob| of the sampled tokens) within
a dtype-dependent bound: 1e-3 in fp32 (same weights, different kernels), 0.1 in bf16.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("SHARDFORGE_GPU_TESTS_ON_CPU") == "1"), reason="no CUDA device"
)


def _run(name: str, assets: dict[str, Any], out: Path, **overrides: Any) -> tuple[list[dict[str, Any]], list[str]]:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.testing.collective_check import CollectiveRecorder
    from shardforge.algorithms.trainers import TRAINERS
    from shardforge.mesh import current_device

    engine = {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 1e-3}, **overrides.pop("engine", {})}
    data: dict[str, Any] = {
        "model": assets["model"], "output_dir": str(out), "layout": "d-1", "steps": 2, "save_every": 0,
        "progress": False, "export_hf_at_end": False, "engine": engine,
    }  # fmt: skip
    if name == "sft":
        data |= {"train_file": str(assets["train"]), "eval_file": str(assets["eval"]), "global_batch_size": 8}
    else:
        data |= {"train_file": str(assets["train"]), "eval_file": str(assets["eval"]), "prompts_per_step": 4,
                 "group_size": 4, "max_new_tokens": 4, "reward_fn": "exact_match", "eval_size": 4}  # fmt: skip
    data |= overrides
    spec = TRAINERS.get(name)
    with CollectiveRecorder() as recorder:
        spec.run(build_config(spec.config_cls, data))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"], recorder.problems(expected_device=current_device())


def test_sft_trainer(assets, world1, tmp_path) -> None:
    rows, problems = _run("sft", assets, tmp_path / "sft", engine={"param_dtype": "bfloat16"})
    assert problems == []
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)


@pytest.mark.parametrize(("dtype", "bound"), [("float32", 1e-3), ("bfloat16", 0.1)])
def test_grpo_embedded_rollouts_logprob_gap(assets, world1, tmp_path, dtype: str, bound: float) -> None:
    rows, problems = _run("grpo", assets, tmp_path / f"grpo_{dtype}", **{"rollout.dtype": dtype},
                          engine={"param_dtype": dtype})  # fmt: skip
    assert problems == []
    gaps = [r["behaviour_kl"] for r in rows]
    print(f"GRPO {dtype}: trainer vs rollout mean |log-prob gap| per step = {gaps}")
    assert len(rows) == 2 and all(g < bound for g in gaps), gaps


def test_ppo_with_critic_and_offloaded_reference(assets, world1, tmp_path) -> None:
    rows, problems = _run(
        "ppo", assets, tmp_path / "ppo", update_epochs=1, kl_coef=0.05, offload_reference=True,
        critic_engine={"max_tokens_per_microbatch": 256, "optimizer": {"lr": 1e-3}},
    )  # fmt: skip
    assert problems == []
    assert len(rows) == 2
    assert all(k in rows[-1] for k in ("kl_ref", "loss")), sorted(rows[-1])
