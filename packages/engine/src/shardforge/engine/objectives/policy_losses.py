"""Policy-gradient losses beyond PPO-clip, registered in `POLICY_LOSSES` under verl's names.

Legend and conventions as in `shardforge.engine.objectives.ppo`: T packed tokens, per-token
inputs [T] target-aligned, zeroed off the loss mask before they get here; ``pi`` the trained
policy (``lp``, differentiable), ``prox`` the proximal/old policy, ``r = pi / prox``, ``A`` the
advantage, ``sg`` stop-gradient. Each function returns the per-token loss ``l_t`` (a loss, to
minimise) that `ppo_actor_loss` then weights with the aggregation coefficients, so every loss
here works with every aggregation mode, micro-batching and data parallelism. Select one with
``actor.policy_loss=<name>``.

| name | per-token loss l_t | paper |
|------|--------------------|-------|
| ``cispo`` | ``-sg[clip(r, 1-eps_low, 1+eps_high)] * A * log pi`` | MiniMax-M1 (MiniMax 2025) |
| ``geo_mean`` | ``-A_i * exp(mean_{t in i} sgn(A_i) min(sgn(A_i) log r_t, sgn(A_i) clip(log r_t, -eps_low, eps_high)))`` on every token of i | GMPO (Zhao et al. 2025) |
| ``sapo`` | ``-A * (4 / tau) * sigmoid(tau (r - 1))``, ``tau = tau_pos if A > 0 else tau_neg`` | SAPO (Gao et al. 2025) |
| ``clip_cov`` | PPO clip, and 0 (no gradient) on a random ``clip_cov.ratio`` share of the unclipped tokens whose ``cov_t = (A_t - mean A)(log pi_t - mean log pi)`` lies in ``(clip_cov.lb, clip_cov.ub)`` | Clip-Cov (Cui et al. 2025) |
| ``kl_cov`` | ``-A r``, plus ``kl_cov.coef * |log pi - log prox|`` on the top ``kl_cov.ratio`` share of tokens by ``cov_t`` | KL-Cov (Cui et al. 2025) |
| ``gpg`` | ``-A * log pi`` | GPG (Chu et al. 2025) |
| ``reinforce`` | ``-A * r`` (importance-weighted vanilla policy gradient, no clip; on-policy its gradient is REINFORCE's ``-A grad log pi``) | Williams 1992 |
| ``dppo_tv`` | ``-A * sg[min(r, c)] * log pi * m_t``, ``m_t = 0`` where ``A > 0`` and ``pi - prox > eps_high`` or ``A < 0`` and ``pi - prox < -eps_low`` (probabilities, not ratios), else 1 | DPPO-Binary-TV (Qi et al. 2026) |
| ``dppo_kl`` | the same with ``m_t = 0`` where the binary KL ``prox log(prox/pi) + (1-prox) log((1-prox)/(1-pi))`` exceeds ``eps_high`` (``A > 0``, ``pi > prox``) or ``eps_low`` (``A < 0``, ``pi < prox``) | DPPO-Binary-KL (Qi et al. 2026) |

Notes:

- ``geo_mean`` is a sequence-level loss: every target token of sequence i carries the same value
  ``-A_i s_i`` (``A_i`` the mean advantage over its targets), so ``seq-mean-token-mean`` gives the
  paper's ``mean_i(-A_i s_i)``. Its clip range is in log space (the paper's ``(e^-0.4, e^0.4)`` is
  ``clip_eps_low = clip_eps_high = 0.4``).
- ``cispo``'s loss *value* is ``-w A log pi`` (its gradient is what matters); MiniMax-M1 sets no
  lower bound on the IS weight: use a ``clip_eps_low`` close to 1 for that.
- ``clip_cov`` / ``kl_cov`` compute the covariance over the micro-batch they are given (as verl
  does over its micro-batch), so unlike the other losses their token selection depends on the
  micro-batch split. ``clip_cov``'s random choice uses a fixed seed, so a run is reproducible.
- ``dual_clip`` and ``ratio_level`` apply to ``vanilla`` / ``gspo``; for ``dppo_*`` ``dual_clip`` is the cap ``c``
  on the importance weight (verl's ``clip_ratio_c``; None = no cap, the paper's form).
- ``dppo_*`` (Divergence PPO, "Rethinking the Trust Region in LLM RL", arXiv 2602.04879): a trust region on
  a divergence between ``pi`` and ``prox`` instead of a ratio clip, estimated from the sampled token alone
  ("binary": the sampled token vs all others). A token is masked only when the update would move the
  policy further out of the region (one-sided, as PPO's clip), so a rare token whose ratio is large but
  whose probability moved little keeps its gradient. The thresholds reuse ``clip_eps_low`` /
  ``clip_eps_high`` as verl's ``dppo_tv`` / ``dppo_kl`` reuse ``clip_ratio_low`` / ``_high``: they bound a
  probability difference (TV) or a KL in nats, not a ratio (0.1-0.2 is the range the paper's recipes
  use). The paper anchors the region to the behaviour policy: use
  ``rollout_correction.mode=bypass`` (engine log-probs as ``prox``) for that.
"""

from __future__ import annotations

import dataclasses

import torch

from shardforge.engine.batching import segment_ids, segment_sum, target_counts
from shardforge.engine.objectives.ppo import (
    _MAX_LOG_RATIO,
    POLICY_LOSSES,
    PolicyLossTerms,
    PPOActorConfig,
    clip_policy_loss,
)

__all__ = [
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "geo_mean_policy_loss",
    "gpg_policy_loss",
    "kl_cov_policy_loss",
    "reinforce_policy_loss",
    "sapo_policy_loss",
]


def _ratio(lp: torch.Tensor, prox: torch.Tensor) -> torch.Tensor:
    return torch.exp((lp - prox).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _terms(
    pg: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor | None = None, low: torch.Tensor | None = None
) -> PolicyLossTerms:
    none = torch.zeros_like(ratio, dtype=torch.bool)
    clipped = none if clipped is None else clipped
    return PolicyLossTerms(pg=pg, ratio=ratio, clipped=clipped, clipped_low=none if low is None else low, dual=none)


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """CISPO (MiniMax-M1, 2025): -sg[clip(r, 1-eps_low, 1+eps_high)] A log pi; every token keeps a gradient."""
    mask = loss_mask != 0
    ratio = _ratio(lp, prox).detach()
    weight = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.eps_high)
    clipped = mask & (weight != ratio)
    return _terms(-adv * weight * lp, ratio, clipped, clipped & (ratio < 1.0 - config.clip_eps_low))


@POLICY_LOSSES.register("geo_mean")
def geo_mean_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """GMPO (Zhao et al. 2025): -A_i x geometric mean of the token-clipped ratios of sequence i (verl: geo_mean)."""
    mask = loss_mask != 0
    seg = segment_ids(cu_seqlens, lp.numel())
    counts = target_counts(loss_mask, cu_seqlens).to(lp.dtype).clamp(min=1.0)
    seq_adv = segment_sum(adv * mask, cu_seqlens) / counts
    sign = torch.sign(seq_adv)[seg]
    log_ratio = (lp - prox).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    clamped = log_ratio.clamp(-config.clip_eps_low, config.eps_high)
    # min(sgn x, sgn clip(x)) * sgn: for A > 0 caps the ratio from above, for A < 0 from below.
    picked = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = torch.exp(segment_sum(torch.where(mask, picked, picked.new_zeros(())), cu_seqlens) / counts)
    pg = torch.where(mask, -seq_adv[seg] * seq_ratio[seg], lp.new_zeros(()))
    clipped = mask & (sign * clamped < sign * log_ratio)
    return _terms(pg, torch.exp(log_ratio).detach(), clipped, clipped & (sign < 0))


@POLICY_LOSSES.register("sapo")
def sapo_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """SAPO (Gao et al. 2025): soft gate -A (4/tau) sigmoid(tau (r - 1)) instead of a hard clip."""
    ratio = _ratio(lp, prox)
    tau = torch.where(adv > 0, lp.new_tensor(config.sapo.tau_pos), lp.new_tensor(config.sapo.tau_neg))
    pg = -adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return _terms(pg, ratio.detach())


def _covariance(lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[T] (A_t - mean A)(log pi_t - mean log pi) over the target tokens (detached; -inf off the mask)."""
    lp_d = lp.detach()
    count = mask.sum().clamp(min=1)
    mean_adv = (adv * mask).sum() / count
    mean_lp = (lp_d * mask).sum() / count
    cov = (adv - mean_adv) * (lp_d - mean_lp)
    return torch.where(mask, cov, cov.new_full((), float("-inf")))


@POLICY_LOSSES.register("clip_cov")
def clip_cov_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """Clip-Cov (Cui et al. 2025): PPO clip; a few high-covariance tokens get no gradient (entropy control)."""
    mask = loss_mask != 0
    base = clip_policy_loss(lp - prox, adv, loss_mask, dataclasses.replace(config, dual_clip=None))
    cov = _covariance(lp, adv, mask)
    candidates = mask & ~base.clipped & (cov > config.clip_cov.lb) & (cov < config.clip_cov.ub)
    index = torch.nonzero(candidates).flatten()
    num = max(int(config.clip_cov.ratio * int(mask.sum())), 1)
    generator = torch.Generator().manual_seed(0)
    chosen_index = index[torch.randperm(index.numel(), generator=generator)[:num].to(index.device)]
    chosen = torch.zeros_like(mask)
    chosen[chosen_index] = True
    pg = torch.where(chosen, base.pg.new_zeros(()), base.pg)
    return _terms(pg, base.ratio.detach(), base.clipped | chosen, base.clipped_low)


@POLICY_LOSSES.register("kl_cov")
def kl_cov_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """KL-Cov (Cui et al. 2025): -A r, plus a |log ratio| penalty on the highest-covariance tokens."""
    mask = loss_mask != 0
    ratio = _ratio(lp, prox)
    pg = -adv * ratio
    chosen = torch.zeros_like(mask)
    num_targets = int(mask.sum())
    if num_targets:
        num = max(int(num_targets * config.kl_cov.ratio), 1)
        chosen[torch.topk(_covariance(lp, adv, mask), num).indices] = True
        pg = torch.where(chosen, pg + config.kl_cov.coef * (lp - prox).abs(), pg)
    return _terms(pg, ratio.detach(), chosen)


@POLICY_LOSSES.register("gpg")
def gpg_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """GPG (Chu et al. 2025): -A log pi, no ratio and no clip (the policy-gradient loss itself)."""
    return _terms(-adv * lp, _ratio(lp, prox).detach())


@POLICY_LOSSES.register("reinforce")
def reinforce_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """Vanilla policy gradient -A r with r = pi/prox, no clipping (REINFORCE, Williams 1992, when on-policy)."""
    ratio = _ratio(lp, prox)
    return _terms(-adv * ratio, ratio.detach())


def _dppo_terms(
    lp: torch.Tensor, prox: torch.Tensor, adv: torch.Tensor, loss_mask: torch.Tensor, config: PPOActorConfig,
    up_blocked: torch.Tensor, down_blocked: torch.Tensor,
) -> PolicyLossTerms:  # fmt: skip
    """-A sg[min(r, c)] log pi on the tokens the trust region keeps (``*_blocked``: masked where A > 0 / A < 0)."""
    mask = loss_mask != 0
    ratio = _ratio(lp, prox).detach()
    weight = ratio if config.dual_clip is None else ratio.clamp(max=config.dual_clip)
    blocked = mask & (((adv > 0) & up_blocked) | ((adv < 0) & down_blocked))
    pg = torch.where(blocked, lp.new_zeros(()), -adv * weight * lp)
    return _terms(pg, ratio, blocked, blocked & (adv < 0))


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """DPPO-Binary-TV (Qi et al. 2026): a trust region on the sampled token's probability change |pi - prox|."""
    change = (torch.exp(lp) - torch.exp(prox)).detach()
    return _dppo_terms(lp, prox, adv, loss_mask, config, change > config.eps_high, change < -config.clip_eps_low)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """DPPO-Binary-KL (Qi et al. 2026): a trust region on KL(prox || pi) of the binary sampled-token-or-not split."""
    p, q = torch.exp(lp.detach()), torch.exp(prox)
    # KL of Bernoulli(q) from Bernoulli(p); clamped so a probability of exactly 1 gives a finite value.
    rest_p, rest_q = (1.0 - p).clamp(min=1e-12), (1.0 - q).clamp(min=1e-12)
    kl = q * (prox - lp.detach()) + rest_q * (torch.log(rest_q) - torch.log(rest_p))
    up, down = (kl > config.eps_high) & (p > q), (kl > config.clip_eps_low) & (p < q)
    return _dppo_terms(lp, prox, adv, loss_mask, config, up, down)
