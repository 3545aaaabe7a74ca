"""GRPO at two gloo ranks with the colocated rollout engine asleep between phases and the policy offloaded while
it generates (trainers/rl_colocate.py): every rank's engine wakes with the version gathered to it in memory, so
the run equals the plain one step for step (both ranks' samples feed the loss: a rank serving freed or stale
weights would show). On CPU the trainer's move to the host is a no-op; the engine's release is real."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("colocate_ranks")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=8, data_seed=2)
    return {"model": str(root / "model"), "train": str(tiny["train"])}


def _run(assets: dict[str, Any], out: Path, colocated: bool) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    data = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": "d2",
        "steps": 2, "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 5, "temperature": 0.9,
        "progress": False, "save_every": 0, "resume": "never", "export_hf_at_end": False,
        "reward_fn": "shardforge.algorithms.testing:digit_reward", "engine": {"max_tokens_per_microbatch": 128, "optimizer": {"lr": 5e-2}},
    }  # fmt: skip
    flags = ["rollout.sleep=true", "offload_train_state_during_rollout=true"] if colocated else []
    run_grpo(build_config(GRPOConfig, apply_overrides(data, flags)))
    if dist.get_rank() != 0:
        return []
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_colocated_sleep_and_offload_at_two_ranks_equal_the_plain_run(assets: dict[str, Any], tmp_path: Path) -> None:
    pool = get_rank_pool(2)
    colocated = pool.run(_run, assets, tmp_path / "colocated", True, timeout_s=240)[0]
    plain = pool.run(_run, assets, tmp_path / "plain", False, timeout_s=240)[0]
    assert len(colocated) == len(plain) == 2
    assert len({r["loss"] for r in plain}) == 2, "the weights must change between steps"
    for a, b in zip(colocated, plain, strict=True):
        for key in ("loss", "grad_norm", "reward_mean", "response_len_mean", "rollout_version"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert a["colocate/switch_s"] >= 0
