"""ReMax (a greedy-baseline advantage) with streaming rollouts (issue 41): each prompt's greedy episode is generated in
its group's generate call, under the same weights, and travels with the group.

- ``max_staleness=0``: the same per-step rewards, baselines, losses and final weights as synchronous ReMax;
- ``max_staleness=1``: no trained group is more than 1 step stale, and every group's greedy episode ran under the
  weight version its samples ran under (recorded at collection);
- with partial rollouts (greedy episodes interrupted like the samples): the bound, per-token staleness, every position
  once.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

STEPS, PROMPTS, GROUP = 3, 4, 3
STREAM = {"async_rollouts": True, "streaming_rollouts": True, "advantage": "remax"}
REWARDS = textwrap.dedent(
    """
    def length_and_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)
    """
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("remax_streaming")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=4, data_seed=2)
    (root / "remax_stream_rewards.py").write_text(REWARDS)
    return {"root": str(root), "model": str(root / "model"), "train": str(tiny["train"])}


def _run(assets: dict[str, Any], out: Path, **overrides: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])
    data = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": "d1",
        "steps": STEPS, "prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": 4, "progress": False,
        "reward_fn": "remax_stream_rewards:length_and_seven", "save_every": 0, "resume": "never",
        "export_hf_at_end": True, "advantage": "remax",
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-2, "eps": 1e-6}},
    }  # fmt: skip
    run_grpo(build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()])))
    weights: dict[str, torch.Tensor] = {}
    for path in sorted((out / "hf").glob("*.safetensors")):
        weights |= load_file(str(path))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {"train": [r for r in map(json.loads, lines) if r["split"] == "train"], "weights": weights}


def test_streaming_remax_at_staleness_zero_equals_synchronous_remax(assets: dict[str, Any], tmp_path: Path) -> None:
    sync = _run(assets, tmp_path / "sync")
    stream = _run(assets, tmp_path / "s0", max_staleness=0, **STREAM)
    assert [r["step"] for r in stream["train"]] == list(range(1, STEPS + 1))
    for a, b in zip(sync["train"], stream["train"], strict=True):
        for key in ("reward_mean", "reward_std", "remax/baseline_mean"):  # the same samples and greedy episodes
            assert b[key] == pytest.approx(a[key], rel=1e-12), (a["step"], key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-8), (a["step"], key, a[key], b[key])
        assert b["stream/staleness_max"] == 0.0
    assert len({r["remax/baseline_mean"] for r in sync["train"]}) > 1, "the baseline changes with the weights"
    worst = max(float((sync["weights"][k] - stream["weights"][k]).abs().max()) for k in sync["weights"])
    assert worst <= 2e-5, worst


def test_streaming_remax_keeps_the_bound_and_each_greedy_episode_runs_with_its_group(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardforge.algorithms.trainers.rl.advantages import GreedyBaseline

    collected: list[tuple[int, set[int]]] = []  # (engine version at the greedy episodes, the samples' token versions)
    collect = GreedyBaseline.collect

    def recording(self: Any, workflow: Any, rollout: Any, rows: Any, params: Any, trajectories: list[Any]) -> None:
        collect(self, workflow, rollout, rows, params, trajectories)
        collected.append((rollout.version, {v for t in trajectories for v in t.versions if v >= 0}))

    monkeypatch.setattr(GreedyBaseline, "collect", recording)
    out = tmp_path / "s1"
    train = _run(assets, out, max_staleness=1, steps=5, **STREAM)["train"]
    assert [r["step"] for r in train] == list(range(1, 6))
    for r in train:
        assert r["stream/staleness_max"] <= 1.0 and r["staleness"] <= 1.0, r
        assert "remax/baseline_mean" in r
    assert any(r["stream/staleness_1_frac"] > 0 for r in train), "the generator ran ahead of the trainer"
    assert len(collected) >= 5
    for version, sample_versions in collected:  # one weight version per call: the samples' and the greedy episodes'
        assert sample_versions == {version}, (version, sample_versions)
    records = [json.loads(x) for x in (out / "streaming" / "rank0.jsonl").read_text().splitlines()]
    positions = sorted(p for r in records for p in r["positions"])
    assert positions == list(range(5 * PROMPTS)), "every prompt position trained once"


def test_streaming_remax_with_partial_rollouts(assets: dict[str, Any], tmp_path: Path) -> None:
    # The greedy episodes run in the group's call, so a weight update interrupts them like the samples.
    partial = {"rollout.partial_rollouts": True, "rollout.interrupt_chunk_tokens": 2, "max_new_tokens": 8}
    out = tmp_path / "p1"
    train = _run(assets, out, max_staleness=1, steps=4, **STREAM, **partial)["train"]
    assert [r["step"] for r in train] == list(range(1, 5))
    for r in train:
        assert r["stream/staleness_max"] <= 1.0 and r["partial/token_staleness_max"] <= 1.0, r
        assert math.isfinite(r["remax/baseline_mean"]) and math.isfinite(r["loss"]), r
    records = [json.loads(x) for x in (out / "streaming" / "rank0.jsonl").read_text().splitlines()]
    assert sorted(p for r in records for p in r["positions"]) == list(range(4 * PROMPTS))
