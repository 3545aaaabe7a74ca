"""`ppo_actor_loss` against a per-token loop written from the papers' formulas.

References: PPO (Schulman et al. 2017), dual clip (Ye et al. 2020), DAPO clip-higher and
token-mean (Yu et al. 2025), decoupled PPO (Hilton et al. 2022, AReaL), GSPO (Zheng et al.
2025), Dr. GRPO (Liu et al. 2025).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardforge.engine import PackedBatch, pack_sequences
from shardforge.engine.objectives import (
    PPOActorConfig,
    PPOActorLossFn,
    aggregation_weight,
    broadcast_to_tokens,
    ppo_actor_loss,
    summarize_stats,
)

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def make_case(lengths: list[int], seed: int = 0, masked_rows: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = (torch.rand(total, generator=gen) < 0.8).float()
    for i in range(len(lengths)):
        if lengths[i] > 1:
            mask[cu[i]] = 0.0  # a sequence start is never a target (unless the sequence is 1 token)
        if i in masked_rows:
            mask[cu[i] : cu[i + 1]] = 0.0
    logprobs = -torch.rand(total, generator=gen) * 3
    return {
        "logprobs": logprobs,
        # log-ratio spread ~0.4 puts plenty of tokens on both sides of a 0.2 clip range
        "old": logprobs + 0.4 * torch.randn(total, generator=gen),
        "prox": logprobs + 0.3 * torch.randn(total, generator=gen),
        "ref": logprobs + 0.3 * torch.randn(total, generator=gen),
        "adv": torch.randn(total, generator=gen),
        "entropy": torch.rand(total, generator=gen) * 2,
        "mask": mask,
        "cu": cu,
    }


def _kl(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    log_r = ref - lp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return torch.exp(log_r) - 1 - log_r


def reference_loss(
    case: dict[str, torch.Tensor],
    lp: torch.Tensor,
    cfg: PPOActorConfig,
    *,
    decoupled: bool = False,
    use_entropy: bool = False,
    use_ref: bool = False,
    gspo_form: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """One token at a time, straight from the formulas; returns (aggregated loss, counts).

    Sequence-level ratios follow the GSPO paper: ``gspo_form="sequence"`` is GSPO's s_i
    differentiated through every token; ``"token"`` is GSPO-token,
    ``s_i,t = sg[s_i] * pi_t / sg[pi_t]`` (the paper's variant for token-wise advantages).
    """
    mask, cu, adv = case["mask"], case["cu"].tolist(), case["adv"]
    prox = case["prox"] if decoupled else case["old"]
    eps_hi = cfg.clip_eps_low if cfg.clip_eps_high is None else cfg.clip_eps_high
    seq_sums, seq_counts = [], []
    clipped = dual = 0
    for i in range(len(cu) - 1):
        targets = [t for t in range(cu[i], cu[i + 1]) if mask[t] != 0]
        total = lp.new_zeros(())
        if targets and cfg.ratio_level == "sequence":
            # GSPO: s_i = (prod_t pi/prox)^(1/|y_i|), differentiated through every token
            seq_ratio = torch.exp(sum(lp[t] - prox[t] for t in targets) / len(targets))
        for t in targets:
            if cfg.ratio_level == "token":
                ratio = torch.exp(lp[t] - prox[t])
            elif gspo_form == "sequence":
                ratio = seq_ratio
            else:
                ratio = seq_ratio.detach() * torch.exp(lp[t] - lp[t].detach())
            a = adv[t]
            unclipped = -a * ratio
            clip_term = -a * torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + eps_hi)
            loss = torch.max(unclipped, clip_term)
            clipped += int(clip_term > unclipped)
            if cfg.dual_clip is not None and a < 0 and -cfg.dual_clip * a < loss:
                loss = -cfg.dual_clip * a + 0 * loss
                dual += 1
            if decoupled:
                w = math.exp(float(case["prox"][t] - case["old"][t]))
                if cfg.behav_weight_cap is not None and w > cfg.behav_weight_cap:
                    w = cfg.behav_weight_cap if cfg.behav_weight_mode == "truncate" else 0.0
                loss = loss * w
            if use_entropy:
                loss = loss - cfg.entropy_coef * case["entropy"][t]
            if use_ref:
                loss = loss + cfg.kl_coef * _kl(lp[t], case["ref"][t], cfg.kl_estimator)
            total = total + loss
        seq_sums.append(total)
        seq_counts.append(len(targets))
    valid = [i for i, n in enumerate(seq_counts) if n > 0]
    if cfg.aggregation == "token-mean":
        result = sum(seq_sums) / sum(seq_counts)
    elif cfg.aggregation == "seq-mean-token-sum":
        result = sum(seq_sums[i] for i in valid) / len(valid)
    elif cfg.aggregation == "seq-mean-token-mean":
        result = sum(seq_sums[i] / seq_counts[i] for i in valid) / len(valid)
    else:
        result = sum(seq_sums[i] / cfg.norm_length for i in valid) / len(valid)
    return result, {"clip": clipped, "dual": dual, "tokens": sum(seq_counts)}


def run(
    case: dict[str, torch.Tensor],
    cfg: PPOActorConfig,
    *,
    decoupled: bool = False,
    use_entropy: bool = False,
    use_ref: bool = False,
):
    lp = case["logprobs"].clone().requires_grad_(True)
    out = ppo_actor_loss(
        lp,
        old_logprobs=case["old"],
        advantages=case["adv"],
        loss_mask=case["mask"],
        cu_seqlens=case["cu"],
        config=cfg,
        proximal_logprobs=case["prox"] if decoupled else None,
        ref_logprobs=case["ref"] if use_ref else None,
        entropy=case["entropy"] if use_entropy else None,
    )
    out.loss.backward()
    return out, lp.grad


def check_against_reference(case, cfg, gspo_form: str = "token", **flags) -> dict[str, float]:
    out, grad = run(case, cfg, **flags)
    lp_ref = case["logprobs"].clone().requires_grad_(True)
    expected, counts = reference_loss(case, lp_ref, cfg, gspo_form=gspo_form, **flags)
    expected.backward()
    torch.testing.assert_close(out.loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, lp_ref.grad, rtol=1e-5, atol=1e-7)
    stats = summarize_stats(out.stats)
    assert stats["num_tokens"] == counts["tokens"]
    assert stats["clip_frac"] == pytest.approx(counts["clip"] / counts["tokens"])
    assert stats["dual_clip_frac"] == pytest.approx(counts["dual"] / counts["tokens"])
    assert stats["loss"] == pytest.approx(float(expected.detach()), rel=1e-5)
    return stats


LENGTHS = [6, 1, 9, 4, 2, 7]


@pytest.mark.parametrize("mode", MODES)
def test_clipped_loss_matches_reference_for_every_aggregation(mode: str) -> None:
    cfg = PPOActorConfig(aggregation=mode, norm_length=16 if mode.endswith("norm") else None)
    stats = check_against_reference(make_case(LENGTHS, seed=1, masked_rows=(3,)), cfg)
    assert 0.1 < stats["clip_frac"] < 0.9  # the case exercises both regions


def test_asymmetric_clip_and_dual_clip_match_reference() -> None:
    cfg = PPOActorConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=1.5)
    case = make_case(LENGTHS, seed=2)
    case["old"] = case["logprobs"] + 0.8 * torch.randn(
        len(case["logprobs"]), generator=torch.Generator().manual_seed(9)
    )
    stats = check_against_reference(case, cfg)
    assert stats["dual_clip_frac"] > 0
    assert stats["clip_low_frac"] + stats["clip_high_frac"] == pytest.approx(stats["clip_frac"])
    assert stats["clip_low_frac"] > 0 and stats["clip_high_frac"] > 0


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_decoupled_loss_matches_reference(mode: str, level: str) -> None:
    cfg = PPOActorConfig(behav_weight_cap=1.3, behav_weight_mode=mode, ratio_level=level)
    stats = check_against_reference(make_case(LENGTHS, seed=3, masked_rows=(0,)), cfg, decoupled=True)
    assert 0 < stats["behav_capped_frac"] < 1
    assert stats["behav_weight_max"] > 1.3


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_entropy_bonus_and_kl_term_match_reference(estimator: str) -> None:
    cfg = PPOActorConfig(entropy_coef=0.01, kl_coef=0.1, kl_estimator=estimator, aggregation="seq-mean-token-mean")
    stats = check_against_reference(make_case(LENGTHS, seed=4), cfg, use_entropy=True, use_ref=True)
    assert stats["entropy"] > 0 and "kl_ref" in stats


@pytest.mark.parametrize("mode", MODES)
def test_gspo_token_form_matches_reference_with_token_advantages(mode: str) -> None:
    cfg = PPOActorConfig(
        ratio_level="sequence", aggregation=mode, norm_length=12.0, clip_eps_low=3e-4, clip_eps_high=4e-4
    )  # GSPO's clip ranges are tiny: sequence ratios stay near 1
    stats = check_against_reference(make_case(LENGTHS, seed=5, masked_rows=(1,)), cfg)
    assert 0 < stats["clip_frac"] < 1


def test_gspo_gradient_equals_sequence_objective_with_sequence_advantages() -> None:
    """With one advantage per sequence and seq-mean-token-mean (GSPO's setting), the
    GSPO-token form must give exactly the gradient of GSPO's sequence objective, whose
    reference differentiates s_i = exp(mean log ratio) through every token."""
    case = make_case(LENGTHS, seed=6, masked_rows=(2,))
    seq_adv = torch.randn(len(LENGTHS), generator=torch.Generator().manual_seed(1))
    case["adv"] = broadcast_to_tokens(seq_adv, case["mask"], case["cu"])
    cfg = PPOActorConfig(ratio_level="sequence", aggregation="seq-mean-token-mean", clip_eps_low=0.05)
    stats = check_against_reference(case, cfg, gspo_form="sequence")
    assert 0 < stats["clip_frac"] < 1
    check_against_reference(case, PPOActorConfig(ratio_level="sequence"), gspo_form="sequence")  # any aggregation
    # Sanity: with advantages that vary inside a sequence the two forms differ, so the check above can fail.
    case["adv"] = torch.randn(case["adv"].numel(), generator=torch.Generator().manual_seed(2))
    _, grad = run(case, cfg)
    lp_ref = case["logprobs"].clone().requires_grad_(True)
    expected, _ = reference_loss(case, lp_ref, cfg, gspo_form="sequence")
    expected.backward()
    assert not torch.allclose(grad, lp_ref.grad, rtol=1e-3, atol=1e-5)


def _single_token(lp: float, old: float, adv: float, cfg: PPOActorConfig, prox: float | None = None):
    lp_t = torch.tensor([0.0, lp], requires_grad=True)
    out = ppo_actor_loss(
        lp_t,
        old_logprobs=torch.tensor([0.0, old]),
        advantages=torch.tensor([0.0, adv]),
        loss_mask=torch.tensor([0.0, 1.0]),
        cu_seqlens=torch.tensor([0, 2]),
        config=cfg,
        proximal_logprobs=None if prox is None else torch.tensor([0.0, prox]),
    )
    out.loss.backward()
    return float(out.loss.detach()), float(lp_t.grad[1]), summarize_stats(out.stats)


@pytest.mark.parametrize(
    ("log_ratio", "adv", "clipped"),
    [
        (0.5, 1.0, True),  # A > 0, r > 1 + eps: no incentive to push further
        (-0.5, 1.0, False),  # A > 0, r < 1 - eps: still pulled up
        (-0.5, -1.0, True),  # A < 0, r < 1 - eps: no incentive to push further down
        (0.5, -1.0, False),  # A < 0, r > 1 + eps: pulled down (unbounded without dual clip)
        (0.1, 1.0, False),  # inside the trust region
    ],
)
def test_gradient_in_each_clip_region(log_ratio: float, adv: float, clipped: bool) -> None:
    loss, grad, stats = _single_token(-1.0 + log_ratio, -1.0, adv, PPOActorConfig())
    ratio = math.exp(log_ratio)
    if clipped:
        assert grad == 0.0
        assert loss == pytest.approx(-adv * min(max(ratio, 0.8), 1.2))
    else:
        assert grad == pytest.approx(-adv * ratio, rel=1e-6)  # d(-A r)/d log pi = -A r
        assert loss == pytest.approx(-adv * ratio, rel=1e-6)
    assert stats["clip_frac"] == float(clipped)


def test_dual_clip_bounds_the_loss_and_zeroes_the_gradient() -> None:
    cfg = PPOActorConfig(dual_clip=3.0)
    loss, grad, stats = _single_token(-1.0 + math.log(5.0), -1.0, -2.0, cfg)  # r = 5 > c = 3, A < 0
    assert loss == pytest.approx(3.0 * 2.0) and grad == 0.0 and stats["dual_clip_frac"] == 1.0
    loss, grad, stats = _single_token(-1.0 + math.log(2.0), -1.0, -2.0, cfg)  # r = 2 < c: ordinary region
    assert loss == pytest.approx(4.0) and grad == pytest.approx(4.0) and stats["dual_clip_frac"] == 0.0
    loss, grad, _ = _single_token(-1.0 + math.log(5.0), -1.0, 2.0, cfg)  # A > 0: dual clip does not apply
    assert loss == pytest.approx(-2.0 * 1.2) and grad == 0.0


def test_decoupled_weight_is_a_constant_and_ratio_is_against_prox() -> None:
    cfg = PPOActorConfig(behav_weight_cap=5.0)
    # pi/prox = e^0.1 (inside the clip range); prox/behav = e^0.5
    loss, grad, stats = _single_token(-1.0, -1.6, 1.0, cfg, prox=-1.1)
    w, r = math.exp(0.5), math.exp(0.1)
    assert loss == pytest.approx(-w * r, rel=1e-6) and grad == pytest.approx(-w * r, rel=1e-6)
    assert stats["behav_weight"] == pytest.approx(w, rel=1e-6)
    lp = torch.tensor([0.0, -1.0], requires_grad=True)
    prox = torch.tensor([0.0, -1.1], requires_grad=True)
    old = torch.tensor([0.0, -1.6], requires_grad=True)
    out = ppo_actor_loss(
        lp,
        old_logprobs=old,
        proximal_logprobs=prox,
        advantages=torch.tensor([0.0, 1.0]),
        loss_mask=torch.tensor([0.0, 1.0]),
        cu_seqlens=torch.tensor([0, 2]),
        config=cfg,
    )
    out.loss.backward()
    assert prox.grad is None and old.grad is None  # both are data, never differentiated


def _loss_over_microbatches(
    loss_fn: PPOActorLossFn, batch: PackedBatch, groups: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine-style: sum of micro-batch loss sums / summed weights; gradient scattered back to [T]."""
    mbs = [batch.select(g) for g in groups]
    weight = sum(float(loss_fn.loss_weight(mb)) for mb in mbs)
    lps = [mb.extras["lp"].clone().requires_grad_(True) for mb in mbs]
    loss = sum(loss_fn(lp, mb) for lp, mb in zip(lps, mbs)) / weight
    loss.backward()
    grads = torch.zeros(batch.num_tokens)
    bounds = batch.cu_seqlens.tolist()
    for lp, g in zip(lps, groups):
        grads[torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in g])] = lp.grad
    return loss.detach(), grads


@pytest.mark.parametrize("mode", MODES)
def test_microbatch_split_gives_the_same_loss_and_gradient(mode: str) -> None:
    lengths = [5, 3, 8, 1, 6, 4]
    case = make_case(lengths, seed=7, masked_rows=(4,))
    cfg = PPOActorConfig(aggregation=mode, norm_length=10.0, ratio_level="sequence", clip_eps_high=0.3)
    loss_fn = PPOActorLossFn(cfg)
    batch = pack_sequences([list(range(n)) for n in lengths])
    batch.loss_mask = case["mask"]
    batch.extras = {"old_logprobs": case["old"], "advantages": case["adv"], "lp": case["logprobs"]}
    whole = _loss_over_microbatches(loss_fn, batch, [list(range(len(lengths)))])
    split = _loss_over_microbatches(loss_fn, batch, [[4, 0], [2], [5, 1, 3]])
    torch.testing.assert_close(split[0], whole[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split[1], whole[1], rtol=1e-6, atol=1e-8)
    assert whole[1].abs().sum() > 0
    merged = summarize_stats(loss_fn.pop_stats())
    assert merged["num_tokens"] == 2 * case["mask"].sum()  # both runs were recorded
    assert merged["loss"] == pytest.approx(float(whole[0]), rel=1e-5)


def test_all_masked_rows_contribute_nothing() -> None:
    case = make_case(LENGTHS, seed=8, masked_rows=(1, 4))
    keep = [0, 2, 3, 5]
    sub = {k: v for k, v in case.items()}
    bounds = case["cu"].tolist()
    index = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in keep])
    for key in ("logprobs", "old", "prox", "ref", "adv", "entropy", "mask"):
        sub[key] = case[key][index]
    sub["cu"] = torch.tensor([0, *torch.tensor([LENGTHS[i] for i in keep]).cumsum(0).tolist()])
    # garbage where nothing is a target must not leak into the loss
    masked = case["mask"] == 0
    case["old"] = case["old"].masked_fill(masked, float("-inf"))
    case["adv"] = case["adv"].masked_fill(masked, float("nan"))
    for mode in MODES:
        cfg = PPOActorConfig(aggregation=mode, norm_length=7.0)
        full, grad = run(case, cfg)
        kept, _ = run(sub, cfg)
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(full.loss.detach(), kept.loss.detach())
        assert float(full.loss_weight) == float(kept.loss_weight)


def test_a_batch_without_targets_gives_zero_not_nan() -> None:
    case = make_case([3, 4], seed=9)
    case["mask"] = torch.zeros(7)
    for mode in MODES:
        out, grad = run(case, PPOActorConfig(aggregation=mode, norm_length=4.0, dual_clip=2.0), decoupled=True)
        assert float(out.loss_sum.detach()) == 0.0 and float(out.loss_weight) == 0.0 and float(out.loss.detach()) == 0.0
        assert torch.equal(grad, torch.zeros(7))
        stats = summarize_stats(out.stats)
        assert all(math.isfinite(v) for v in stats.values()), stats
        assert stats["ratio_max"] == 0.0 and stats["clip_frac"] == 0.0


def test_single_token_sequences() -> None:
    case = make_case([1, 1, 1, 2], seed=10)
    case["mask"] = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    for level in ("token", "sequence"):
        check_against_reference(case, PPOActorConfig(ratio_level=level, aggregation="seq-mean-token-mean"))


def test_huge_log_ratios_stay_finite() -> None:
    lp = torch.tensor([0.0, 0.0, -1.0], requires_grad=True)
    out = ppo_actor_loss(
        lp,
        old_logprobs=torch.tensor([0.0, -200.0, -1.0]),
        advantages=torch.tensor([0.0, 1.0, 1.0]),
        loss_mask=torch.tensor([0.0, 1.0, 1.0]),
        cu_seqlens=torch.tensor([0, 3]),
    )
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert float(lp.grad[1]) == 0.0  # clipped (A > 0, r >> 1 + eps)


def test_bad_inputs_raise_clear_errors() -> None:
    case = make_case([3, 4], seed=11)
    base = {"old_logprobs": case["old"], "advantages": case["adv"], "loss_mask": case["mask"], "cu_seqlens": case["cu"]}
    lp = case["logprobs"]
    with pytest.raises(ValueError, match=r"advantages has shape \(6,\); expected \(7,\)"):
        ppo_actor_loss(lp, **{**base, "advantages": case["adv"][:6]})
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T=7"):
        ppo_actor_loss(lp, **{**base, "cu_seqlens": torch.tensor([0, 3, 6])})
    with pytest.raises(ValueError, match="non-decreasing"):
        ppo_actor_loss(lp, **{**base, "cu_seqlens": torch.tensor([0, 5, 3, 7])})
    with pytest.raises(ValueError, match="1-D"):
        ppo_actor_loss(lp[None], **base)
    bad = case["adv"].clone()
    bad[case["mask"].nonzero()[0, 0]] = float("nan")
    with pytest.raises(ValueError, match="advantages holds 1 non-finite"):
        ppo_actor_loss(lp, **{**base, "advantages": bad})
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        ppo_actor_loss(lp, **base, config=PPOActorConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        ppo_actor_loss(lp, **base, config=PPOActorConfig(entropy_coef=0.1))
    for kwargs, match in [
        ({"clip_eps_low": 1.0}, "clip_eps_low must be in"),
        ({"clip_eps_high": 0.0}, "clip_eps_high must be > 0"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1"),
        ({"ratio_level": "seq"}, "valid: \\['token', 'sequence'\\]"),
        ({"aggregation": "mean"}, "unknown loss aggregation 'mean'"),
        ({"aggregation": "seq-mean-token-sum-norm"}, "needs norm_length > 0"),
        ({"behav_weight_cap": 0.5}, "behav_weight_cap must be >= 1"),
        ({"behav_weight_mode": "clip"}, "valid: \\['truncate', 'mask'\\]"),
        ({"kl_estimator": "k4"}, "unknown kl_estimator"),
        ({"entropy_coef": -1.0}, "must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            PPOActorConfig(**kwargs)


def test_loss_fn_handles_engine_placeholder_and_missing_extras() -> None:
    loss_fn = PPOActorLossFn()
    placeholder = pack_sequences([[0]])
    lp = torch.zeros(1, requires_grad=True)
    assert float(loss_fn(lp, placeholder).detach()) == 0.0 and float(loss_fn.loss_weight(placeholder)) == 0.0
    batch = pack_sequences([[1, 2, 3]])
    with pytest.raises(KeyError, match="no extra 'old_logprobs'"):
        loss_fn(torch.zeros(3), batch)
    # The engine passes the per-token entropy to loss functions that ask for it.
    bonus = PPOActorLossFn(PPOActorConfig(entropy_coef=0.1))
    assert bonus.wants_entropy
    batch.extras = {"old_logprobs": torch.zeros(3), "advantages": torch.ones(3)}
    with pytest.raises(ValueError, match="entropy"):
        bonus(torch.zeros(3), batch)  # a bonus without the entropy tensor is an error, not a silent 0
    assert torch.isfinite(bonus(torch.zeros(3), batch, entropy=torch.full((3,), 0.5)))


def test_aggregation_weight_counts() -> None:
    mask = torch.tensor([0.0, 1, 1, 0, 0, 0, 1])
    cu = torch.tensor([0, 3, 5, 7])
    assert float(aggregation_weight(mask, cu, "token-mean")) == 3
    assert float(aggregation_weight(mask, cu, "seq-mean-token-mean")) == 2  # the middle row has no target
