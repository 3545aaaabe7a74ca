"""GRPO at two ranks publishes to every rank's embedded HF rollout engine in memory
(trainers/rl_publish.py: the full weights gathered to each rank in turn): the run equals the disk
path's step for step (both ranks' samples feed the loss, so a rank left on old weights would show),
and nothing is written under output_dir/weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("publish_ranks")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=8, data_seed=2)
    return {"model": str(root / "model"), "train": str(tiny["train"])}


def _run(assets: dict[str, Any], out: Path, layout: str, in_memory: bool) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    data = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": layout,
        "steps": 3, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 5, "temperature": 0.9,
        "progress": False, "save_every": 0, "resume": "never", "export_hf_at_end": False,
        "reward_fn": "shardforge.algorithms.testing:digit_reward", "engine": {"max_tokens_per_microbatch": 128, "optimizer": {"lr": 5e-2}},
    }  # fmt: skip
    run_grpo(build_config(GRPOConfig, apply_overrides(data, [f"rollout.publish_in_memory={str(in_memory).lower()}"])))
    if dist.get_rank() != 0:
        return []
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


@pytest.mark.parametrize("layout", ["d2", "t2"])
def test_in_memory_publish_at_two_ranks_equals_the_disk_path(
    assets: dict[str, Any], tmp_path: Path, layout: str
) -> None:
    from shardforge.weight_sync import DiskWeightSource

    pool = get_rank_pool(2)
    memory = pool.run(_run, assets, tmp_path / "memory", layout, True, timeout_s=240)[0]
    disk = pool.run(_run, assets, tmp_path / "disk", layout, False, timeout_s=240)[0]
    assert len(memory) == len(disk) == 3
    assert len({r["loss"] for r in memory}) == 3, "the weights must change between steps"
    for a, b in zip(memory, disk, strict=True):
        for key in ("loss", "grad_norm", "reward_mean", "rollout_version"):
            assert a[key] == b[key], (key, a[key], b[key])
    assert DiskWeightSource(tmp_path / "memory" / "weights").latest() is None, "the memory path wrote to disk"
    assert DiskWeightSource(tmp_path / "disk" / "weights").latest() == 4
