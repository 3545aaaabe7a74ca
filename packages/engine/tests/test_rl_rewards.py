"""Reward shaping, the Bradley-Terry reward-model loss, and stats reduction across micro-batches/ranks."""

from __future__ import annotations

import math

import pytest
import torch

from shardforge.engine.objectives import (
    PPOActorConfig,
    RewardShapingConfig,
    all_reduce_stats,
    bradley_terry_loss,
    last_token_scores,
    merge_stats,
    overlong_penalty,
    ppo_actor_loss,
    shape_rewards,
    summarize_stats,
)
from shardforge.mesh.testing import get_rank_pool


def _dapo_penalty(length: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13, case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_overlong_penalty_matches_dapo_piecewise_formula() -> None:
    lengths = list(range(0, 30))
    got = overlong_penalty(torch.tensor(lengths), max_length=20, cache_length=8)
    expected = [_dapo_penalty(n, 20, 8) for n in lengths]
    torch.testing.assert_close(got, torch.tensor(expected))
    assert got[12] == 0.0 and got[16] == -0.5 and got[20] == -1.0 and got[21] == -1.0  # the corners
    hard = overlong_penalty(torch.tensor([20, 21]), max_length=20, cache_length=0)
    assert hard.tolist() == [0.0, -1.0]


def test_shape_rewards_order_is_penalty_then_scale_then_clip() -> None:
    rewards, lengths = torch.tensor([1.0, 1.0, -3.0, 0.5]), torch.tensor([5, 18, 5, 25])
    cfg = RewardShapingConfig(overlong_max_length=20, overlong_cache_length=4, overlong_factor=0.5, scale=2.0, clip=1.5)
    got = shape_rewards(rewards, cfg, response_lengths=lengths)
    expected = [
        max(-1.5, min(1.5, 2.0 * (r + 0.5 * _dapo_penalty(n, 20, 4))))
        for r, n in zip(rewards.tolist(), lengths.tolist(), strict=True)
    ]
    torch.testing.assert_close(got, torch.tensor(expected))
    assert shape_rewards(rewards, RewardShapingConfig()).tolist() == rewards.tolist()


def test_shape_rewards_errors() -> None:
    with pytest.raises(ValueError, match="rewards holds 1 non-finite"):
        shape_rewards(torch.tensor([1.0, math.nan]), RewardShapingConfig())
    with pytest.raises(ValueError, match="needs response_lengths"):
        shape_rewards(torch.tensor([1.0]), RewardShapingConfig(overlong_max_length=10))
    with pytest.raises(ValueError, match="overlong_cache_length must be in"):
        RewardShapingConfig(overlong_max_length=10, overlong_cache_length=11)
    with pytest.raises(ValueError, match="clip must be > 0"):
        RewardShapingConfig(clip=0.0)


def test_bradley_terry_loss_gradient_and_accuracy() -> None:
    gen = torch.Generator().manual_seed(0)
    chosen = torch.randn(9, generator=gen).requires_grad_(True)
    rejected = torch.randn(9, generator=gen).requires_grad_(True)
    with torch.no_grad():
        rejected[3] = chosen[3]  # a tie counts as wrong
    margin = torch.rand(9, generator=gen)
    out = bradley_terry_loss(chosen, rejected, margin=margin)
    out.loss.backward()
    c, r, m = chosen.tolist(), rejected.tolist(), margin.tolist()
    expected = sum(math.log1p(math.exp(-(ci - ri - mi))) for ci, ri, mi in zip(c, r, m, strict=True)) / 9
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-5)
    # d/d s_c of -log sigmoid(d) = -(1 - sigmoid(d)) / P, and the opposite for s_r
    expected_grad = [-(1 - 1 / (1 + math.exp(-(ci - ri - mi)))) / 9 for ci, ri, mi in zip(c, r, m, strict=True)]
    torch.testing.assert_close(chosen.grad, torch.tensor(expected_grad), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rejected.grad, -torch.tensor(expected_grad), rtol=1e-5, atol=1e-7)
    stats = summarize_stats(out.stats, per="num_pairs")
    assert stats["accuracy"] == pytest.approx(sum(ci > ri for ci, ri in zip(c, r, strict=True)) / 9)
    assert stats["num_pairs"] == 9 and stats["loss"] == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="one score per pair"):
        bradley_terry_loss(chosen, rejected[:3])
    with pytest.raises(ValueError, match="chosen_scores holds 1 non-finite"):
        bradley_terry_loss(torch.tensor([math.nan]), torch.tensor([0.0]))


def test_last_token_scores() -> None:
    values = torch.arange(7.0)
    assert last_token_scores(values, torch.tensor([0, 3, 4, 7])).tolist() == [2.0, 3.0, 6.0]
    with pytest.raises(ValueError, match=r"sequence\(s\) \[1\] are empty"):
        last_token_scores(values, torch.tensor([0, 3, 3, 7]))


def test_merge_and_summarize_stats() -> None:
    a = {
        "num_tokens": torch.tensor(2.0),
        "x": torch.tensor(4.0),
        "x_max": torch.tensor(3.0),
        "x_min": torch.tensor(1.0),
        "loss_sum": torch.tensor(2.0),
        "loss_weight": torch.tensor(2.0),
    }
    b = {
        "num_tokens": torch.tensor(6.0),
        "x": torch.tensor(4.0),
        "x_max": torch.tensor(-math.inf),
        "x_min": torch.tensor(-5.0),
        "loss_sum": torch.tensor(6.0),
        "loss_weight": torch.tensor(2.0),
    }
    stats = summarize_stats(merge_stats([a, b]))
    assert stats == {
        "num_tokens": 8.0,
        "x": 1.0,
        "x_max": 3.0,
        "x_min": -5.0,
        "loss_sum": 8.0,
        "loss_weight": 4.0,
        "loss": 2.0,
    }
    assert summarize_stats(merge_stats([{"num_tokens": torch.tensor(0.0), "x_max": torch.tensor(-math.inf)}])) == {
        "num_tokens": 0.0,
        "x_max": 0.0,
    }
    with pytest.raises(ValueError, match="no count 'num_pairs'"):
        summarize_stats(a, per="num_pairs")


def _actor_stats_on_rank(lengths: list[int], seed: int) -> dict[str, float]:
    import torch.distributed as dist

    from shardforge.engine.objectives import PPOActorConfig, all_reduce_stats, merge_stats, ppo_actor_loss

    case = _case(lengths, seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    bounds = case["cu"].tolist()
    mine = [i for i in range(len(lengths)) if i % world == rank]
    outs = []
    for i in mine:  # one micro-batch per sequence
        sl = slice(bounds[i], bounds[i + 1])
        outs.append(
            ppo_actor_loss(
                case["lp"][sl],
                old_logprobs=case["old"][sl],
                advantages=case["adv"][sl],
                loss_mask=case["mask"][sl],
                cu_seqlens=torch.tensor([0, lengths[i]]),
                config=PPOActorConfig(dual_clip=2.0),
            ).stats
        )
    return {k: float(v) for k, v in all_reduce_stats(merge_stats(outs), dist.group.WORLD).items()}


def _case(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    lp = -torch.rand(total, generator=gen) * 2
    mask = (torch.rand(total, generator=gen) < 0.8).float()
    return {
        "lp": lp,
        "old": lp + 0.5 * torch.randn(total, generator=gen),
        "adv": torch.randn(total, generator=gen),
        "mask": mask,
        "cu": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
    }


def test_stats_reduced_over_ranks_equal_the_single_process_stats() -> None:
    lengths, seed = [4, 7, 3, 6, 5], 3
    case = _case(lengths, seed)
    whole = ppo_actor_loss(
        case["lp"],
        old_logprobs=case["old"],
        advantages=case["adv"],
        loss_mask=case["mask"],
        cu_seqlens=case["cu"],
        config=PPOActorConfig(dual_clip=2.0),
    )
    expected = summarize_stats(all_reduce_stats(whole.stats))  # no process group here: identity
    for reduced in get_rank_pool(2).run(_actor_stats_on_rank, lengths, seed):
        got = summarize_stats({k: torch.tensor(v, dtype=torch.float64) for k, v in reduced.items()})
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
