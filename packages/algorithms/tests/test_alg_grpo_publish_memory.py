"""GRPO and PPO at world 1 publish to the embedded HF rollout engine in memory (trainers/rl_publish.py):
the samples after every publish equal the disk path's, the versions match, and nothing is
written under output_dir/weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardforge.weight_sync import DiskWeightSource


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("publish")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=8, data_seed=2)
    return {"model": str(root / "model"), "train": tiny["train"], "eval": tiny["eval"]}


def _run(
    assets: dict[str, Any], out: Path, monkeypatch: pytest.MonkeyPatch, trainer: str = "grpo", **overrides: Any
) -> dict[str, Any]:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers import TRAINERS
    from shardforge.rollout import HFRolloutEngine

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "eval_file": str(assets["eval"]),
        "output_dir": str(out), "layout": "d1", "steps": 3, "prompts_per_step": 4, "group_size": 4,
        "max_new_tokens": 5, "temperature": 0.9, "progress": False, "save_every": 0, "resume": "never",
        "export_hf_at_end": False, "eval_size": 4, "reward_fn": "shardforge.algorithms.testing:digit_reward",
        "engine": {"max_tokens_per_microbatch": 128, "optimizer": {"lr": 5e-2}},
    }  # fmt: skip
    spec = TRAINERS.get(trainer)
    config = build_config(spec.config_cls, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))
    samples: list[tuple[int, list[list[int]]]] = []
    original = HFRolloutEngine.generate

    def recording(self: HFRolloutEngine, prompts: Any, params: Any) -> Any:
        outs = original(self, prompts, params)
        samples.append((self.version, [o.response_ids for o in outs]))
        return outs

    monkeypatch.setattr(HFRolloutEngine, "generate", recording)
    summary = spec.run(config)
    monkeypatch.setattr(HFRolloutEngine, "generate", original)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"samples": samples, "train": [r for r in rows if r["split"] == "train"], "summary": summary}


def test_in_memory_publish_serves_what_the_disk_path_serves(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = _run(assets, tmp_path / "memory", monkeypatch)
    disk = _run(assets, tmp_path / "disk", monkeypatch, **{"rollout.publish_in_memory": "false"})
    # Every generate call (evaluation at start and end, one per step) on the same version, same samples.
    assert [v for v, _ in memory["samples"]] == [v for v, _ in disk["samples"]] == [1, 1, 2, 3, 4]
    assert memory["samples"] == disk["samples"]
    assert len({str(s) for _, s in memory["samples"][1:4]}) == 3, "the weights change between steps"
    for a, b in zip(memory["train"], disk["train"], strict=True):
        for key in ("loss", "grad_norm", "reward_mean", "rollout_version"):
            assert a[key] == b[key], key
    assert memory["summary"]["accuracy_end"] == disk["summary"]["accuracy_end"]
    assert DiskWeightSource(tmp_path / "memory" / "weights").latest() is None, "the memory path wrote to disk"
    assert DiskWeightSource(tmp_path / "disk" / "weights").latest() == 4


def test_ppo_publishes_in_memory_too(assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    memory = _run(assets, tmp_path / "memory", monkeypatch, "ppo", group_size=2, update_epochs=2)
    disk = _run(
        assets,
        tmp_path / "disk",
        monkeypatch,
        "ppo",
        group_size=2,
        update_epochs=2,
        **{"rollout.publish_in_memory": "false"},
    )
    assert [v for v, _ in memory["samples"]] == [v for v, _ in disk["samples"]]
    assert memory["samples"] == disk["samples"]
    assert len({str(s) for _, s in memory["samples"][1:4]}) == 3, "the weights change between steps"
    for a, b in zip(memory["train"], disk["train"], strict=True):
        for key in ("loss", "grad_norm", "critic/loss", "reward_mean", "rollout_version"):
            assert a[key] == b[key], key
    assert DiskWeightSource(tmp_path / "memory" / "weights").latest() is None, "the memory path wrote to disk"
    assert DiskWeightSource(tmp_path / "disk" / "weights").latest() is not None
