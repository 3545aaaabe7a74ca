"""Dynamic sampling (rollout/dynamic_sampling.py): the zero-variance filter on raw rewards, the
backfill order, the cap on rounds, and GRPO runs (sync and async) with it on."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.algorithms.rollout import Rollout
from shardforge.algorithms.rollout.dynamic_sampling import DynamicSampler, DynamicSamplingConfig, filter_groups

GROUP = 2


def test_filter_groups_by_reason() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.5, -1.0, -1.0])
    keep, all_pass, all_fail = filter_groups(rewards, GROUP)
    assert keep.tolist() == [False, False, True, False, False]
    assert all_pass.tolist() == [True, False, False, True, False]
    assert all_fail.tolist() == [False, True, False, False, True]
    with pytest.raises(ValueError, match="not whole groups of 3"):
        filter_groups(rewards, 3)


def _fake_round(table: dict[tuple[int, int], list[float]]) -> Any:
    """Rounds whose rewards come from ``table[(index, round)]``; each rollout records its origin."""
    calls: list[tuple[int, int]] = []

    def generate(index: int, round_: int) -> tuple[list[Rollout], torch.Tensor]:
        calls.append((index, round_))
        rewards = table[(index, round_)]
        rollouts = [
            Rollout(prompt_index=i // GROUP, prompt_ids=[1], response_ids=[round_, i], logprobs=[0.0, 0.0],
                    finished=True, version=0)
            for i in range(len(rewards))
        ]  # fmt: skip
        return rollouts, torch.tensor(rewards)

    return generate, calls


def test_backfill_keeps_the_first_informative_groups_in_generation_order() -> None:
    table = {
        (0, 0): [1, 1, 0, 1, 0, 0],  # kept: group 1
        (0, 1): [1, 0, 1, 1, 0, 1],  # kept: groups 0, 2 -> the target (2) is met after group 0
    }
    generate, calls = _fake_round(table)
    sampler = DynamicSampler(generate, group_size=GROUP, target_groups=2, config=DynamicSamplingConfig(enabled=True))
    rollouts, rewards = sampler(0)
    assert calls == [(0, 0), (0, 1)], "stops as soon as the target is met"
    assert [r.response_ids for r in rollouts] == [[0, 2], [0, 3], [1, 0], [1, 1]]
    assert rewards.tolist() == [0.0, 1.0, 1.0, 0.0]
    stats = sampler.pop_stats(0)
    assert stats == {"groups_generated": 6.0, "groups_kept": 2.0, "filtered_all_pass": 2.0,
                     "filtered_all_fail": 1.0, "rounds": 2.0, "cap_hit": 0.0}  # fmt: skip
    assert sampler.pop_stats(0)["rounds"] == 0.0, "popped; a restored batch reports zeros"


def test_the_cap_on_rounds_trains_on_fewer_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    table = {(5, 0): [1, 1, 1, 0], (5, 1): [0, 0, 0, 0]}
    generate, calls = _fake_round(table)
    config = DynamicSamplingConfig(enabled=True, max_rounds=2)
    sampler = DynamicSampler(generate, group_size=GROUP, target_groups=2, config=config)
    with caplog.at_level(logging.WARNING):
        rollouts, rewards = sampler(5)
    assert calls == [(5, 0), (5, 1)] and rewards.tolist() == [1.0, 0.0]
    assert "batch 5 kept 1 of 2 groups after max_rounds=2" in caplog.text
    assert sampler.pop_stats(5)["cap_hit"] == 1.0
    # Nothing informative at all: the rank keeps its last group (advantage 0) to have a batch.
    generate, _ = _fake_round({(1, 0): [1, 1, 0, 0]})
    none_kept = DynamicSampler(generate, group_size=GROUP, target_groups=2, config=DynamicSamplingConfig(max_rounds=1))
    rollouts, rewards = none_kept(1)
    assert rewards.tolist() == [0.0, 0.0] and len(rollouts) == 2
    with pytest.raises(ValueError, match="max_rounds=0 must be >= 1"):
        DynamicSamplingConfig(max_rounds=0)


REWARDS = textwrap.dedent(
    """
    def binary_seven(prompt, response, reference):
        return float("7" in response)
    """
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("dynamic_sampling")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=4, data_seed=2)
    (root / "ds_rewards_mod.py").write_text(REWARDS)
    sys.path.insert(0, str(root))
    return {"model": str(root / "model"), "train": str(tiny["train"])}


def _run(assets: dict[str, Any], out: Path, **overrides: Any) -> list[dict[str, Any]]:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    data = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": "d1",
        "steps": 2, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4, "progress": False,
        "reward_fn": "ds_rewards_mod:binary_seven", "save_every": 0, "export_hf_at_end": False,
        "dynamic_sampling": {"enabled": True, "max_rounds": 4},
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    run_grpo(build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()])))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_with_dynamic_sampling_trains_only_informative_groups(
    assets: dict[str, Any], tmp_path: Path, mode: str
) -> None:
    train = _run(assets, tmp_path / mode, async_rollouts=mode == "async")
    for r in train:
        kept, generated = r["dynamic_sampling/groups_kept"], r["dynamic_sampling/groups_generated"]
        filtered = r["dynamic_sampling/filtered_all_pass"] + r["dynamic_sampling/filtered_all_fail"]
        assert 1 <= r["dynamic_sampling/rounds"] <= 4 and kept + filtered <= generated
        assert kept == 4 or r["dynamic_sampling/cap_hit"] == 1.0, r
        # Every trained group has a reward spread, so the batch's rewards vary, and with a binary reward no
        # sample of such a group sits on its mean: every trained token carries a non-zero advantage.
        assert r["reward_std"] > 0 and r["advantage_nonzero_frac"] == 1.0, r
    # The binary reward leaves most groups of this untrained model without a signal: the filter acts.
    assert sum(r["dynamic_sampling/filtered_all_fail"] for r in train) > 0
    assert any(r["dynamic_sampling/rounds"] > 1 for r in train), "backfill rounds ran"
    if mode == "sync":  # without the filter, the groups it drops train with zero advantages
        plain = _run(assets, tmp_path / "plain", **{"dynamic_sampling.enabled": False})
        # Step 1 samples round 0 from the same weights and seeds in both runs (later steps' weights differ).
        assert train[0]["dynamic_sampling/filtered_all_fail"] + train[0]["dynamic_sampling/filtered_all_pass"] > 0
        assert plain[0]["advantage_nonzero_frac"] < 1.0, plain
