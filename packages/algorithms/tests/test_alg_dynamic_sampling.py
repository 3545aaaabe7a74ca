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

from shardforge.algorithms.trainers.rl.dynamic_sampling import DynamicSampler, DynamicSamplingConfig, filter_groups
from shardforge.rollout import Rollout

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


def _sharded_rounds(table: dict[tuple[int, int], list[float]], rank: int, dp: int) -> Any:
    """Rank ``rank``'s share of `_fake_round`'s global rounds: positions rank, rank + dp, ... (batch rows 0, 1, ...);
    each rollout records (round, global position)."""

    def generate(index: int, round_: int) -> tuple[list[Rollout], torch.Tensor]:
        rewards = table[(index, round_)]
        rollouts, mine = [], []
        for row, position in enumerate(range(rank, len(rewards) // GROUP, dp)):
            for i in range(GROUP):
                rollouts.append(Rollout(prompt_index=row, prompt_ids=[1], response_ids=[round_, position],
                                        logprobs=[0.0, 0.0], finished=True, version=0))  # fmt: skip
                mine.append(rewards[position * GROUP + i])
        return rollouts, torch.tensor(mine)

    return generate


class _Exchange:
    """`keep_exchange` between threads (a barrier instead of a process group)."""

    def __init__(self, dp: int) -> None:
        import threading

        self.flags: list[list[bool]] = [[] for _ in range(dp)]
        self.barrier = threading.Barrier(dp)

    def for_rank(self, rank: int) -> Any:
        def exchange(flags: list[bool]) -> list[list[bool]]:
            self.flags[rank] = flags
            self.barrier.wait()
            every = [list(f) for f in self.flags]
            self.barrier.wait()
            return every

        return exchange


@pytest.mark.parametrize(
    "table",
    [
        # uneven shares: rank 0 holds three of the four chosen groups
        {(0, 0): [1, 0, 0, 0, 1, 0, 0, 0], (0, 1): [0, 0, 0, 0, 1, 0, 0, 1]},
        # the target is met inside round 1: its later informative groups are left out on both ranks
        {(0, 0): [0, 0, 1, 0, 0, 0, 0, 1], (0, 1): [1, 0, 0, 1, 1, 0, 0, 1]},
        # the cap is hit: every rank trains on what was chosen
        {(0, 0): [0, 0, 1, 0, 0, 0, 0, 0], (0, 1): [0, 0, 0, 0, 1, 0, 0, 0], (0, 2): [1, 1, 1, 1, 0, 1, 0, 0]},
    ],
)
def test_two_ranks_choose_world1s_groups(table: dict[tuple[int, int], list[float]]) -> None:
    """Two data-parallel ranks, each generating its share of every round, keep together exactly world 1's groups
    (same rounds, same statistics summed), because they choose in global position order after exchanging flags."""
    from concurrent.futures import ThreadPoolExecutor

    config = DynamicSamplingConfig(enabled=True, max_rounds=3)
    generate, _ = _fake_round(table)
    world1 = DynamicSampler(generate, group_size=GROUP, target_groups=4, config=config)
    rollouts, rewards = world1(0)
    expected = sorted((r.response_ids[0], r.response_ids[1] // GROUP, float(w)) for r, w in zip(rollouts, rewards))
    exchange = _Exchange(2)
    ranks = [
        DynamicSampler(_sharded_rounds(table, k, 2), group_size=GROUP, target_groups=2, config=config,
                       dp_rank=k, dp_size=2, exchange=exchange.for_rank(k))
        for k in range(2)
    ]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda s: s(0), ranks))
    got = sorted((r.response_ids[0], r.response_ids[1], float(w)) for out in results for r, w in zip(*out))
    assert got == expected  # (round, global position, reward) of every kept sample
    stats = [s.pop_stats(0) for s in ranks]
    one = world1.pop_stats(0)
    for key in ("groups_generated", "groups_kept", "filtered_all_pass", "filtered_all_fail"):
        assert sum(st[key] for st in stats) == one[key], key
    assert all(st["rounds"] == one["rounds"] and st["cap_hit"] == one["cap_hit"] for st in stats)
    with pytest.raises(ValueError, match="needs an exchange"):
        DynamicSampler(generate, group_size=GROUP, target_groups=2, config=config, dp_size=2)


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
    return {"model": str(root / "model"), "train": str(tiny["train"]), "root": str(root)}


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


def _run_and_weights(assets: dict[str, Any], out: Path, **overrides: Any) -> dict[str, Any]:
    """`_run` on every rank of a pool (or here); rank 0 returns the train metrics and the exported weights."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])
    train = _run(assets, out, export_hf_at_end=True, **overrides)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    weights: dict[str, torch.Tensor] = {}
    for path in sorted((out / "hf").glob("*.safetensors")):
        weights |= load_file(str(path))
    return {"train": train, "weights": weights}


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.heavy), "async"])  # one path in CI
def test_grpo_with_dynamic_sampling_two_ranks_match_world1(assets: dict[str, Any], tmp_path: Path, mode: str) -> None:
    """FSDP 2 trains on world 1's groups: after every round the ranks exchange which of their groups carry a
    signal (a gloo group of its own, also from the asynchronous generator thread) and choose in global order.
    Samples are the same by per-request seeds; losses agree because the engine normalises over the global batch.
    Metrics to rel 1e-5 and weights after 2 Adam steps to 2e-5, as the other layout tests; the group counts are
    exact given the same samples (a sampled token moved by rounding would change the losses far more)."""
    from shardforge.mesh.testing import get_rank_pool

    settings = {"prompts_per_step": 8, "async_rollouts": mode == "async"}
    single = _run_and_weights(assets, tmp_path / "d1", **settings)
    shared = {k: assets[k] for k in ("model", "train", "root")}
    fsdp = get_rank_pool(2).run(_run_and_weights, shared, tmp_path / "d2", layout="d2", timeout_s=300, **settings)[0]
    assert [r["step"] for r in fsdp["train"]] == [1, 2]
    assert any(r["dynamic_sampling/rounds"] > 1 for r in single["train"]), "backfill rounds ran"
    for a, b in zip(single["train"], fsdp["train"], strict=True):
        for key in ("loss", "grad_norm", "reward_mean", "reward_std", "response_len_mean", "advantage_nonzero_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-8), (a["step"], key, a[key], b[key])
        for key in ("groups_generated", "groups_kept", "filtered_all_pass", "filtered_all_fail", "rounds", "cap_hit"):
            assert b[f"dynamic_sampling/{key}"] == a[f"dynamic_sampling/{key}"], (a["step"], key)
    worst = max(float((single["weights"][k] - v).abs().max()) for k, v in fsdp["weights"].items())
    assert worst <= 2e-5, worst
