"""Rollout correction (objectives/rollout_correction.py): every mode against a float64 reference
written from its formula, batch normalisation, the statistics under an injected mismatch, the
actor loss's use of the weights, and config errors."""

from __future__ import annotations

import math

import pytest
import torch

from shardforge.engine.objectives import (
    ROLLOUT_CORRECTIONS,
    PPOActorConfig,
    RolloutCorrectionConfig,
    ppo_actor_loss,
    rollout_correction,
)

# 5 sequences of prompt + response tokens; the third has no target token (a prompt only).
PROMPTS, RESPONSES = [2, 3, 4, 1, 2], [5, 3, 0, 7, 4]


def _batch(seed: int = 0, scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.cat([torch.cat([torch.zeros(p), torch.ones(r)]) for p, r in zip(PROMPTS, RESPONSES, strict=True)])
    lengths = torch.tensor([p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    old = -torch.rand(mask.numel(), generator=gen) * 3
    behav = old + scale * torch.randn(mask.numel(), generator=gen)
    # Off the mask the values are ignored, whatever they are.
    old = torch.where(mask != 0, old, torch.full_like(old, -math.inf))
    return old, behav, mask, cu


def _reference(
    old: torch.Tensor,
    behav: torch.Tensor,
    mask: torch.Tensor,
    cu: torch.Tensor,
    mode: str,
    cfg: RolloutCorrectionConfig,
) -> tuple[list[float], list[bool], list[bool]]:
    """weights, kept, truncated per token, from the formulas in the module docstring (Python floats)."""
    level = {"token": "token", "icepop": "token", "seq": "sequence", "geo": "geometric"}[mode.split("_")[0]]
    action = "mask" if mode.endswith("mis") or mode == "icepop" else "truncate"
    low, high = cfg.band()
    n = mask.numel()
    weights, kept, truncated = [0.0] * n, [False] * n, [False] * n
    bounds = cu.tolist()
    for i in range(len(bounds) - 1):
        tokens = [t for t in range(bounds[i], bounds[i + 1]) if mask[t] != 0]
        log_r = {t: float(old[t].double()) - float(behav[t].double()) for t in tokens}
        for t in tokens:
            if level == "token":
                r = math.exp(log_r[t])
            elif level == "sequence":
                r = math.exp(sum(log_r.values()))
            else:
                r = math.exp(sum(log_r.values()) / len(tokens))
            if action == "truncate":
                weights[t], kept[t], truncated[t] = min(r, cfg.cap), True, r > cfg.cap
            else:
                kept[t] = low <= r <= high
                weights[t] = r if kept[t] else 0.0
    return weights, kept, truncated


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("token_tis", {"cap": 1.2}),
        ("token_mis", {"high": 1.3}),
        ("icepop", {}),
        ("icepop", {"low": 0.8, "high": 1.25}),
        ("seq_tis", {"cap": 1.1}),
        ("seq_mis", {"low": 0.3, "high": 3.0}),
        ("geo_tis", {"cap": 1.05}),
        ("geo_mis", {"low": 0.9, "high": 1.1}),
    ],
)
def test_each_mode_matches_its_formula(mode: str, options: dict[str, float]) -> None:
    old, behav, mask, cu = _batch()
    cfg = RolloutCorrectionConfig(mode=mode, **options)
    out = rollout_correction(old, behav, mask, cu, cfg)
    weights, kept, truncated = _reference(old, behav, mask, cu, mode, cfg)
    assert torch.allclose(out.weights.double(), torch.tensor(weights, dtype=torch.float64), rtol=1e-6, atol=0)
    assert (out.loss_mask != 0).tolist() == kept
    assert float(out.stats["truncated_frac"]) == sum(truncated)
    assert float(out.stats["masked_frac"]) == float(mask.sum()) - sum(kept)
    # The test data exercises both sides of each mode's threshold.
    if cfg.mode.endswith("tis"):
        assert 0 < sum(truncated) < mask.sum()
    else:
        assert 0 < sum(kept) < mask.sum()


def test_none_and_bypass_are_weight_one_and_bypass_skips_recomputation() -> None:
    old, behav, mask, cu = _batch()
    for mode in ("none", "bypass"):
        out = rollout_correction(old, behav, mask, cu, RolloutCorrectionConfig(mode=mode))
        assert torch.equal(out.weights, mask.float()) and torch.equal(out.loss_mask, mask)
    assert ROLLOUT_CORRECTIONS.get("bypass").recompute is False
    assert all(ROLLOUT_CORRECTIONS.get(m).recompute for m in ROLLOUT_CORRECTIONS.names() if m != "bypass")


def test_statistics_match_their_definitions() -> None:
    old, behav, mask, cu = _batch()
    out = rollout_correction(old, behav, mask, cu, RolloutCorrectionConfig(mode="token_tis", cap=1.2))
    m = mask != 0
    log_r = old.double()[m] - behav.double()[m]
    assert float(out.stats["kl_k1"]) == pytest.approx(float((-log_r).sum()), rel=1e-9)
    assert float(out.stats["kl_k3"]) == pytest.approx(float((log_r.exp() - 1 - log_r).sum()), rel=1e-9)
    bounds, gaps, worst = cu.tolist(), [], []
    for i in range(len(bounds) - 1):
        lr = [float(old[t]) - float(behav[t]) for t in range(bounds[i], bounds[i + 1]) if mask[t] != 0]
        if lr:
            gaps.append(-sum(lr) / len(lr))
            worst.append(math.exp(max(abs(x) for x in lr)))
    assert float(out.stats["num_sequences"]) == 4
    assert float(out.stats["log_ppl_gap"]) == pytest.approx(sum(gaps), rel=1e-6)
    assert float(out.stats["seq_worst_ratio"]) == pytest.approx(sum(worst), rel=1e-6)
    assert float(out.stats["seq_worst_ratio_max"]) == pytest.approx(max(worst), rel=1e-6)
    assert float(out.stats["ratio_max"]) == pytest.approx(float(log_r.exp().max()), rel=1e-6)


@pytest.mark.parametrize(("mode", "per_sequence"), [("token_tis", False), ("icepop", False), ("seq_tis", True)])
def test_batch_normalize_makes_the_mean_weight_one(mode: str, per_sequence: bool) -> None:
    old, behav, mask, cu = _batch()
    raw = rollout_correction(old, behav, mask, cu, RolloutCorrectionConfig(mode=mode, cap=3.0))
    out = rollout_correction(old, behav, mask, cu, RolloutCorrectionConfig(mode=mode, cap=3.0, batch_normalize=True))
    kept = out.loss_mask != 0
    if per_sequence:  # one weight per sequence with target tokens: their mean is 1
        seq = [out.weights[b:e][kept[b:e]] for b, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
        seq = [float(w[0]) for w in seq if w.numel()]
        assert sum(seq) / len(seq) == pytest.approx(1.0, rel=1e-6)
    else:
        assert float(out.weights[kept].double().mean()) == pytest.approx(1.0, rel=1e-6)
    ratio = out.weights[kept] / raw.weights[kept]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio)), "normalisation is one global factor"


def test_an_injected_mismatch_moves_the_fractions_and_the_kl() -> None:
    """behav = old + noise of growing scale: zero noise gives KL 0 and weights 1; more noise gives
    a larger mismatch KL, more truncated (TIS) and more masked (IcePop, token MIS) tokens."""
    results = {}
    for scale in (0.0, 0.05, 0.5, 2.0):
        old, behav, mask, cu = _batch(seed=3, scale=scale)
        row = {}
        for mode in ("token_tis", "icepop", "token_mis"):
            stats = rollout_correction(old, behav, mask, cu, RolloutCorrectionConfig(mode=mode)).stats
            row[mode] = stats
        results[scale] = row
    zero = results[0.0]["token_tis"]
    assert float(zero["kl_k1"]) == 0 and float(zero["kl_k3"]) == 0 and float(zero["weight_max"]) == 1.0
    assert float(zero["truncated_frac"]) == 0 and float(results[0.0]["icepop"]["masked_frac"]) == 0
    scales = sorted(results)
    k3 = [float(results[s]["token_tis"]["kl_k3"]) for s in scales]
    truncated = [float(results[s]["token_tis"]["truncated_frac"]) for s in scales]
    masked = [float(results[s]["icepop"]["masked_frac"]) for s in scales]
    assert k3 == sorted(k3) and k3[1] > 0 and k3[-1] > 100 * k3[1]
    assert truncated == sorted(truncated) and truncated[1] == 0 < truncated[-1]
    assert masked == sorted(masked) and masked[1] == 0 < masked[-1]
    # Same noise: the one-sided token MIS [0, 2] masks only what TIS truncates (ratios above 2).
    big = results[2.0]
    assert float(big["token_mis"]["masked_frac"]) == float(big["token_tis"]["truncated_frac"])


def test_the_actor_loss_multiplies_the_policy_gradient_by_the_weights() -> None:
    old, behav, mask, cu = _batch()
    old = torch.where(mask != 0, old, torch.zeros_like(old))
    out = rollout_correction(old, behav, mask, cu, RolloutCorrectionConfig(mode="token_tis", cap=1.2))
    adv = torch.randn(mask.numel(), generator=torch.Generator().manual_seed(1))
    lp = (old + 0.1 * torch.randn(mask.numel(), generator=torch.Generator().manual_seed(2))).requires_grad_()
    cfg = PPOActorConfig()
    plain = ppo_actor_loss(lp, old_logprobs=old, advantages=adv, loss_mask=mask, cu_seqlens=cu, config=cfg)
    weighted = ppo_actor_loss(
        lp, old_logprobs=old, advantages=adv, loss_mask=mask, cu_seqlens=cu, config=cfg, is_weights=out.weights
    )
    # token-mean: loss_sum = sum_t w_t l_t, the plain one sum_t l_t (one extra weight per token).
    ratio = (lp.detach() - old).exp()
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * mask
    assert float(plain.loss_sum.detach()) == pytest.approx(float(pg.sum()), rel=1e-5)
    assert float(weighted.loss_sum.detach()) == pytest.approx(float((pg * out.weights).sum()), rel=1e-5)


def test_config_errors_say_what_is_valid() -> None:
    with pytest.raises(ValueError, match=r"unknown rollout_correction.mode 'tis'; registered: \[.*'token_tis'"):
        RolloutCorrectionConfig(mode="tis")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        RolloutCorrectionConfig(cap=0.5)
    with pytest.raises(ValueError, match=r"needs low < high; got low=2\.0, high=2\.0"):
        RolloutCorrectionConfig(mode="token_mis", low=2.0)
    assert RolloutCorrectionConfig(mode="icepop").band() == (0.5, 5.0)
    assert RolloutCorrectionConfig(mode="token_mis").band() == (0.0, 2.0)
