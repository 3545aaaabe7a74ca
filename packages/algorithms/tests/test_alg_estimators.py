"""Advantage estimators OPO, pass@k GRPO, ReMax, token-weighted REINFORCE++ (outcome form), the
straight-through KL estimators and the KL controllers, against float64 references written from the
papers' formulas, with zero-variance groups."""

from __future__ import annotations

import math

import pytest
import torch

from shardforge.engine.objectives import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    broadcast_to_tokens,
    kl_estimate,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from shardforge.engine.objectives.advantages import group_advantages
from shardforge.engine.objectives.kl_control import KLControlConfig, build_kl_controller

# two groups of 3: the second has all-equal rewards (zero variance)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.3, 0.3, 0.3], dtype=torch.float64)
LENGTHS = torch.tensor([4.0, 2.0, 6.0, 1.0, 5.0, 3.0], dtype=torch.float64)


def test_opo_subtracts_the_length_weighted_group_mean() -> None:
    out = group_advantages(REWARDS, 3, "opo", response_lengths=LENGTHS)
    expected = []
    for g in range(2):
        r, n = REWARDS[3 * g : 3 * g + 3].tolist(), LENGTHS[3 * g : 3 * g + 3].tolist()
        baseline = sum(a * b for a, b in zip(r, n, strict=True)) / sum(n)
        expected += [x - baseline for x in r]
    assert out.tolist() == pytest.approx(expected, abs=1e-12)
    assert out[3:].tolist() == [0.0, 0.0, 0.0]


def test_grpo_passk_rewards_only_the_best_sample() -> None:
    out = group_advantages(REWARDS, 3, "grpo_passk")
    std = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64).std().item()
    assert out.tolist() == pytest.approx([(1.0 - 0.5) / (std + 1e-6), 0, 0, 0, 0, 0], abs=1e-12)
    with pytest.raises(ValueError, match="group_size must be an integer >= 2"):
        group_advantages(REWARDS, 1, "grpo_passk")


def test_remax_subtracts_the_greedy_reward_of_each_prompt() -> None:
    out = group_advantages(REWARDS, 3, "remax", baseline_rewards=torch.tensor([0.5, 0.3], dtype=torch.float64))
    assert out.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, 0.0], abs=1e-12)
    with pytest.raises(ValueError, match=r"'remax' needs \['baseline_rewards'\], which this trainer does not"):
        group_advantages(REWARDS, 3, "remax", response_lengths=LENGTHS)


def _packed(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt of 2 tokens + response per sequence."""
    mask: list[float] = []
    cu = [0]
    for n in lengths:
        mask += [0.0, 0.0] + [1.0] * n
        cu.append(len(mask))
    return torch.tensor(mask), torch.tensor(cu)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_outcome_reinforce_pp_whitens_over_tokens_like_the_token_level_form(name: str) -> None:
    """The outcome form with response lengths equals verl's token-level form broadcast per sequence."""
    mask, cu = _packed([int(n) for n in LENGTHS.tolist()])
    out = group_advantages(REWARDS, 3, name, response_lengths=LENGTHS)
    if name == "reinforce_plus_plus":
        token_level = reinforce_pp_advantages(REWARDS, mask, cu)
        centered = REWARDS
    else:
        token_level = reinforce_pp_baseline_advantages(REWARDS, mask, cu, 3)
        centered = REWARDS - REWARDS.reshape(2, 3).mean(1).repeat_interleave(3)
    torch.testing.assert_close(broadcast_to_tokens(out, mask, cu), token_level.to(out.dtype), rtol=1e-6, atol=1e-6)
    # float64 reference: every token of sequence i holds x_i; mean/std over tokens
    tokens = [x for x, n in zip(centered.tolist(), LENGTHS.tolist(), strict=True) for _ in range(int(n))]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / len(tokens))
    assert out.tolist() == pytest.approx([(x - mean) / (std + 1e-8) for x in centered.tolist()], abs=1e-10)
    # without lengths each sequence counts once (the previous behaviour), which differs here
    assert not torch.allclose(out, ADVANTAGE_ESTIMATORS.get(name)(REWARDS, 3))


def test_zero_variance_batches_give_zero() -> None:
    flat = torch.full((6,), 0.7, dtype=torch.float64)
    for name in ["opo", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo", "rloo"]:
        assert group_advantages(flat, 3, name, response_lengths=LENGTHS).abs().max() == 0.0, name


@pytest.mark.parametrize(("name", "forward"), [("k1+", "k1"), ("k3+", "k3")])
def test_straight_through_kl_has_the_value_of_one_and_the_gradient_of_k2(name: str, forward: str) -> None:
    lp = torch.tensor([-1.0, -2.0, -0.3], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.3], dtype=torch.float64)
    value = kl_estimate(lp, ref, name)
    assert torch.equal(value.detach(), kl_estimate(lp.detach(), ref, forward))
    value.sum().backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, lp.detach() - ref)  # d/dlp (lp - ref)^2 / 2
    assert name in KL_ESTIMATORS


def test_adaptive_kl_controller_follows_ziegler_et_al() -> None:
    config = KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl = build_kl_controller(config)
    ctrl.update(0.5, 10)  # far above target: error clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    before = ctrl.value
    ctrl.update(0.04, 10)  # below target: shrinks by (0.04/0.05 - 1) * 10/100
    assert ctrl.value == pytest.approx(before * (1 - 0.2 * 10 / 100))
    fixed = build_kl_controller(KLControlConfig(kl_coef=0.1))
    fixed.update(10.0, 10)
    assert fixed.value == 0.1
    with pytest.raises(ValueError, match=r"unknown kl_ctrl type 'pid'; registered: \['adaptive', 'fixed'\]"):
        KLControlConfig(type="pid")
