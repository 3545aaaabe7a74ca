"""Advantage estimators against loops written from the papers' formulas.

GAE (Schulman et al. 2016), GRPO (Shao et al. 2024), Dr. GRPO (Liu et al. 2025), RLOO
(Ahmadian et al. 2024), REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from shardforge.engine.objectives import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    token_rewards,
    whiten,
)


def make_case(lengths: list[int], seed: int = 0, masked_rows: tuple[int, ...] = ()):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    # holes in the middle of responses (e.g. tool outputs) as well as prompts
    mask = (torch.rand(total, generator=gen) < 0.7).float()
    for i in masked_rows:
        mask[cu[i] : cu[i + 1]] = 0.0
    return {
        "rewards": torch.randn(total, generator=gen),
        "values": torch.randn(total, generator=gen),
        "mask": mask,
        "cu": cu,
    }


def targets_of(mask: torch.Tensor, cu: torch.Tensor) -> list[list[int]]:
    bounds = cu.tolist()
    return [[t for t in range(bounds[i], bounds[i + 1]) if mask[t] != 0] for i in range(len(bounds) - 1)]


def reference_gae(case, gamma: float, lam: float) -> tuple[list[float], list[float]]:
    r, v = case["rewards"].tolist(), case["values"].tolist()
    adv, ret = [0.0] * len(r), [0.0] * len(r)
    for targets in targets_of(case["mask"], case["cu"]):
        for k, t in enumerate(targets):
            # A_k = sum_l (gamma lam)^l delta_{k+l}, delta_j = r_j + gamma V_{j+1} - V_j, V after the end = 0
            total = 0.0
            for j in range(k, len(targets)):
                next_v = v[targets[j + 1]] if j + 1 < len(targets) else 0.0
                delta = r[targets[j]] + gamma * next_v - v[targets[j]]
                total += (gamma * lam) ** (j - k) * delta
            adv[t] = total
            ret[t] = total + v[t]
    return adv, ret


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5)])
def test_gae_matches_reference(gamma: float, lam: float) -> None:
    case = make_case([7, 1, 12, 3, 9, 2], seed=1, masked_rows=(3,))
    adv, ret = gae_advantages(case["rewards"], case["values"], case["mask"], case["cu"], gamma=gamma, lam=lam)
    exp_adv, exp_ret = reference_gae(case, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(exp_adv), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, torch.tensor(exp_ret), rtol=1e-5, atol=1e-5)
    assert (adv[case["mask"] == 0] == 0).all() and (ret[case["mask"] == 0] == 0).all()


def test_gae_single_target_sequences_and_no_targets() -> None:
    rewards, values = torch.tensor([0.0, 2.0, 5.0, 7.0]), torch.tensor([9.0, 0.5, 3.0, 1.0])
    mask, cu = torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 2, 4])
    adv, ret = gae_advantages(rewards, values, mask, cu, gamma=0.9, lam=0.9)
    assert adv.tolist() == [0.0, 1.5, 0.0, 0.0] and ret.tolist() == [0.0, 2.0, 0.0, 0.0]  # A = r - V, bootstrap 0
    adv, ret = gae_advantages(rewards, values, torch.zeros(4), cu)
    assert adv.tolist() == [0.0] * 4 and ret.tolist() == [0.0] * 4


def test_gae_ignores_garbage_off_the_mask_and_rejects_it_on_the_mask() -> None:
    case = make_case([5, 6], seed=2)
    clean, _ = gae_advantages(case["rewards"], case["values"], case["mask"], case["cu"], gamma=0.95, lam=0.9)
    off = case["mask"] == 0
    dirty, _ = gae_advantages(
        case["rewards"].masked_fill(off, float("nan")),
        case["values"].masked_fill(off, float("inf")),
        case["mask"],
        case["cu"],
        gamma=0.95,
        lam=0.9,
    )
    torch.testing.assert_close(dirty, clean)
    bad = case["rewards"].clone()
    bad[int(case["mask"].nonzero()[0, 0])] = float("nan")
    with pytest.raises(ValueError, match="rewards holds 1 non-finite"):
        gae_advantages(bad, case["values"], case["mask"], case["cu"])
    with pytest.raises(ValueError, match=r"values has shape \(10,\); expected \(11,\)"):
        gae_advantages(case["rewards"], case["values"][:10], case["mask"], case["cu"])
    with pytest.raises(ValueError, match="gamma and lam must be in"):
        gae_advantages(case["rewards"], case["values"], case["mask"], case["cu"], lam=1.5)


def test_discounted_returns_match_reference() -> None:
    case = make_case([6, 4, 1], seed=3)
    got = discounted_returns(case["rewards"], case["mask"], case["cu"], gamma=0.8)
    r = case["rewards"].tolist()
    expected = [0.0] * len(r)
    for targets in targets_of(case["mask"], case["cu"]):
        for k, t in enumerate(targets):
            expected[t] = sum(0.8 ** (j - k) * r[targets[j]] for j in range(k, len(targets)))
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ group baselines
def _groups(rewards: list[float], size: int) -> list[list[float]]:
    return [rewards[i : i + size] for i in range(0, len(rewards), size)]


def test_grpo_dr_grpo_and_rloo_match_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    rewards = torch.randn(12, generator=gen)
    rewards[4:8] = 0.3  # a zero-std group: advantage exactly 0 (no signal), never (r - mean) / eps
    got_grpo = grpo_advantages(rewards, 4)
    got_biased = grpo_advantages(rewards, 4, unbiased_std=False)
    got_dr, got_rloo = dr_grpo_advantages(rewards, 4), rloo_advantages(rewards, 4)
    expected_grpo, expected_biased, expected_dr, expected_rloo = [], [], [], []
    for group in _groups(rewards.tolist(), 4):
        mean = statistics.fmean(group)
        constant = max(group) == min(group)
        for i, r in enumerate(group):
            expected_grpo.append(0.0 if constant else (r - mean) / (statistics.stdev(group) + 1e-6))
            expected_biased.append(0.0 if constant else (r - mean) / (statistics.pstdev(group) + 1e-6))
            expected_dr.append(0.0 if constant else r - mean)
            others = group[:i] + group[i + 1 :]
            expected_rloo.append(0.0 if constant else r - statistics.fmean(others))
    for got, expected in [
        (got_grpo, expected_grpo),
        (got_biased, expected_biased),
        (got_dr, expected_dr),
        (got_rloo, expected_rloo),
    ]:
        torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert got_grpo[4:8].tolist() == [0.0] * 4 and got_rloo[4:8].tolist() == [0.0] * 4


def test_zero_std_groups_get_exactly_zero_even_when_the_mean_rounds() -> None:
    # float32 mean of three 0.9s is not 0.9: without the explicit rule, (r - mean) / (std + eps)
    # would turn rounding noise into a sizeable advantage.
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.0, 1.0, 1.0])
    assert float((rewards[:3] - rewards[:3].mean()).abs().max()) > 0  # the premise of this test
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        got = fn(rewards, 3)
        assert got[:3].tolist() == [0.0, 0.0, 0.0], fn.__name__
        assert (got[3:] != 0).all(), fn.__name__


def test_group_size_one_and_bad_groups() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0])
    assert grpo_advantages(rewards, 1).tolist() == [0.0, 0.0, 0.0]  # a lone sample has no baseline
    with pytest.raises(ValueError, match="group_size must be an integer >= 2"):
        rloo_advantages(rewards, 1)
    with pytest.raises(ValueError, match=r"3 rewards cannot be split into groups of 2: .* \(e\.g\. 2 or 4\)"):
        grpo_advantages(rewards, 2)
    with pytest.raises(ValueError, match="group_size must be an integer >= 1"):
        grpo_advantages(rewards, 0)
    with pytest.raises(ValueError, match="rewards is empty"):
        grpo_advantages(torch.zeros(0), 4)
    with pytest.raises(ValueError, match="rewards holds 1 non-finite"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match=r"rewards must be 1-D \[N\]"):
        rloo_advantages(torch.zeros(2, 2), 2)


# ------------------------------------------------------------------ REINFORCE++
def _whiten_reference(values: list[float], eps: float = 1e-8) -> list[float]:
    if max(values) == min(values):
        return [0.0] * len(values)
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    return [(x - mean) / (std + eps) for x in values]


def reference_reinforce_pp(seq_rewards, case, logprobs, ref_logprobs, kl_coef, gamma, group_size=None):
    rewards = seq_rewards.tolist()
    if group_size is not None:
        rewards = [r - statistics.fmean(g) for g in _groups(rewards, group_size) for r in g]
    all_targets = targets_of(case["mask"], case["cu"])
    returns: dict[int, float] = {}
    for i, targets in enumerate(all_targets):
        token_r = [-kl_coef * float(logprobs[t] - ref_logprobs[t]) for t in targets]  # k1 KL in the reward
        if targets:
            token_r[-1] += rewards[i]
        for k, t in enumerate(targets):
            returns[t] = sum(gamma ** (j - k) * token_r[j] for j in range(k, len(targets)))
    order = sorted(returns)
    normed = dict(zip(order, _whiten_reference([returns[t] for t in order]), strict=True))
    return [normed.get(t, 0.0) for t in range(case["mask"].numel())]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference(gamma: float) -> None:
    case = make_case([5, 8, 3, 6, 4, 7], seed=5, masked_rows=(2,))
    gen = torch.Generator().manual_seed(6)
    seq_rewards = torch.randn(6, generator=gen)
    lp, ref = -torch.rand(case["mask"].numel(), generator=gen), -torch.rand(case["mask"].numel(), generator=gen)
    got = reinforce_pp_advantages(
        seq_rewards, case["mask"], case["cu"], logprobs=lp, ref_logprobs=ref, kl_coef=0.05, gamma=gamma
    )
    expected = reference_reinforce_pp(seq_rewards, case, lp, ref, 0.05, gamma)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-4, atol=1e-5)
    got = reinforce_pp_baseline_advantages(
        seq_rewards, case["mask"], case["cu"], 3, logprobs=lp, ref_logprobs=ref, kl_coef=0.05, gamma=gamma
    )
    expected = reference_reinforce_pp(seq_rewards, case, lp, ref, 0.05, gamma, group_size=3)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-4, atol=1e-5)
    on = case["mask"] != 0
    assert abs(float(got[on].mean())) < 1e-5 and float(got[on].std(correction=0)) == pytest.approx(1.0, rel=1e-4)


def test_reinforce_pp_edge_cases() -> None:
    mask, cu = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 3, 5])
    # equal rewards, no KL: every return is equal -> whitened to 0, not NaN
    assert reinforce_pp_baseline_advantages(torch.tensor([1.0, 1.0]), mask, cu, 2).tolist() == [0.0] * 5
    assert reinforce_pp_advantages(torch.tensor([2.0, 2.0]), torch.tensor([0.0, 0, 1, 0, 1]), cu).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="needs both logprobs"):
        reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, cu, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"rewards must be \[N\] with N=2"):
        reinforce_pp_advantages(torch.tensor([1.0]), mask, cu)
    with pytest.raises(ValueError, match="rewards holds 1 non-finite"):
        reinforce_pp_advantages(torch.tensor([1.0, math.inf]), mask, cu)


def test_whiten_and_token_rewards() -> None:
    values, mask = torch.tensor([5.0, 1.0, 2.0, 3.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])
    expected = _whiten_reference([1.0, 2.0, 3.0])
    torch.testing.assert_close(whiten(values, mask), torch.tensor([0.0, *expected]))
    assert whiten(values, torch.zeros(4)).tolist() == [0.0] * 4
    mask, cu = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]), torch.tensor([0, 4, 5, 7])
    got = token_rewards(torch.tensor([3.0, 4.0, 5.0]), mask, cu)
    assert got.tolist() == [0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 5.0]  # the all-masked middle row's reward is dropped
