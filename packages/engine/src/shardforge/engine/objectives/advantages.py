"""Advantage estimators: GAE on packed sequences, group baselines (GRPO, Dr. GRPO, RLOO), REINFORCE++.

Legend: T = packed tokens, N = sequences, G = group size (samples per prompt). Groups are
contiguous: sequences ``[k*G, (k+1)*G)`` answer the same prompt. Per-token results are [T],
0 off the loss mask; per-sequence results are [N] (spread them over the tokens with
`broadcast_to_tokens`). All functions run without autograd: advantages are data.

Conventions that avoid silent NaN:

- a group whose rewards are all equal (std 0, including G = 1) gets advantage exactly 0:
  it carries no learning signal, and (r - mean) / (0 + eps) would only amplify rounding;
- likewise whitening a batch whose values are all equal gives 0;
- tokens outside the loss mask are skipped by GAE (the recursion jumps to the next target
  token of the same sequence) and get 0; sequences without a target token get 0;
- non-finite rewards/values and malformed groups raise `ValueError`.

Estimators are registered by name (verl's names) in `ADVANTAGE_ESTIMATORS`. Outcome
(group-level) estimators share one signature, ``fn(rewards [N], group_size) -> [N]``, and are
what GRPO's ``advantage`` names (`shardforge.algorithms.rlvr.group_advantages`): ``grpo``,
``dr_grpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``opo``,
``grpo_passk``, ``remax``. Estimators that need more than the rewards declare it as a keyword
argument (``response_lengths`` [N], ``baseline_rewards`` [N/G]); `group_advantages` passes
those the caller has. ``gae`` is the
token-level `gae_advantages` (it needs a critic's values; the PPO trainer calls it). Register
your own with ``@ADVANTAGE_ESTIMATORS.register("name")`` or name it as ``"package.module:fn"``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from shardforge.core.registry import Registry
from shardforge.engine.batching import check_cu_seqlens, check_finite, check_tokens, segment_ids
from shardforge.engine.objectives.kl import KLEstimator, kl_estimate
from shardforge.engine.objectives.rewards import token_rewards

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "GroupAdvantageFn",
    "discounted_returns",
    "dr_grpo_advantages",
    "gae_advantages",
    "group_advantages",
    "grpo_advantages",
    "grpo_passk_advantages",
    "opo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_outcome_advantages",
    "reinforce_pp_outcome_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "whiten",
]

GroupAdvantageFn = Callable[[torch.Tensor, int], torch.Tensor]
"""An outcome estimator: ``fn(rewards [N], group_size) -> advantages [N]`` (groups contiguous)."""

ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry("advantage estimator")


# ------------------------------------------------------------------ per-token recursions
def _compact(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row, column) of every target token in an [N, L] matrix of targets, L = longest target run."""
    mask = loss_mask != 0
    seg = segment_ids(cu_seqlens, mask.numel())
    cumulative = torch.cat([mask.new_zeros(1, dtype=torch.long), torch.cumsum(mask.long(), 0)])
    before = cumulative[cu_seqlens[:-1].long()]  # targets before each sequence starts
    rank = cumulative[1:] - 1 - before[seg]
    rows, cols = seg[mask], rank[mask]
    width = int(cols.max()) + 1 if cols.numel() else 0
    return rows, cols, width


def _check_gamma_lambda(gamma: float, lam: float) -> None:
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must be in [0, 1]; got gamma={gamma}, lam={lam}")


@ADVANTAGE_ESTIMATORS.register(
    "gae", doc="GAE with a critic (token level, needs values; the PPO trainer's estimator, not a group one)"
)
@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016) per packed sequence.

    Over the target tokens t_1 < ... < t_n of a sequence (the actions),
    ``delta_k = r_k + gamma V_{k+1} - V_k`` with ``V_{n+1} = 0`` (the episode ends with the
    sequence), ``A_k = delta_k + gamma lam A_{k+1}``, and returns ``R_k = A_k + V_k``.
    ``values[t]`` is the critic's value of the state *before* token t (target-aligned);
    ``rewards[t]`` the reward for emitting token t (the sequence reward usually sits on the
    last target token, see `token_rewards`). Rewards and values off the mask are ignored.

    Returns:
        (advantages [T], returns [T]), 0 off the mask, in the promoted dtype of the inputs.
    """
    num_tokens = rewards.numel()
    check_cu_seqlens(cu_seqlens, num_tokens)
    check_tokens("rewards", rewards, num_tokens)
    check_tokens("values", values, num_tokens)
    check_tokens("loss_mask", loss_mask, num_tokens)
    _check_gamma_lambda(gamma, lam)
    mask = loss_mask != 0
    check_finite("rewards", rewards, mask)
    check_finite("values", values, mask)
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    rows, cols, width = _compact(loss_mask, cu_seqlens)
    num_seqs = cu_seqlens.numel() - 1
    # Padding slots after a sequence's last target hold r = V = 0, so the recursion
    # bootstraps V = 0 at the end and padding never leaks into real tokens.
    r_NL = rewards.new_zeros((num_seqs, width + 1), dtype=dtype)
    v_NL = torch.zeros_like(r_NL)
    r_NL[rows, cols] = rewards[mask].to(dtype)
    v_NL[rows, cols] = values[mask].to(dtype)
    adv_NL = torch.zeros_like(r_NL)
    running = r_NL.new_zeros(num_seqs)
    for k in range(width - 1, -1, -1):
        delta = r_NL[:, k] + gamma * v_NL[:, k + 1] - v_NL[:, k]
        running = delta + gamma * lam * running
        adv_NL[:, k] = running
    advantages = rewards.new_zeros(num_tokens, dtype=dtype)
    advantages[mask] = adv_NL[rows, cols]
    returns = torch.where(mask, advantages + values.to(dtype), advantages.new_zeros(()))
    return advantages, returns


def discounted_returns(
    rewards: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """[T] ``G_k = sum_{j >= k} gamma^(j-k) r_j`` over each sequence's target tokens (0 off the mask)."""
    advantages, _ = gae_advantages(rewards, torch.zeros_like(rewards), loss_mask, cu_seqlens, gamma=gamma, lam=1.0)
    return advantages


@torch.no_grad()
def whiten(values: torch.Tensor, loss_mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """[T] ``(x - mean) / (std + eps)`` over target tokens (population std), 0 off the mask.

    All-equal values (or no targets) give 0 rather than amplified rounding noise.
    """
    check_tokens("loss_mask", loss_mask, values.numel())
    mask = loss_mask != 0
    picked = values[mask]
    out = torch.zeros_like(values)
    if picked.numel() == 0 or bool(picked.max() == picked.min()):
        return out
    mean = picked.mean()
    std = picked.std(correction=0)
    out[mask] = (picked - mean) / (std + eps)
    return out


# ------------------------------------------------------------------ group baselines
def _grouped(rewards: torch.Tensor, group_size: int, min_size: int = 1) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N] (one per sequence), got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < min_size:
        raise ValueError(f"group_size must be an integer >= {min_size} (samples per prompt); got {group_size!r}")
    num = rewards.numel()
    if num == 0:
        raise ValueError("rewards is empty: there are no groups to compute advantages for")
    if num % group_size != 0:
        lower = num - num % group_size
        hint = f"{lower} or {lower + group_size}" if lower else f"{group_size}"
        raise ValueError(
            f"{num} rewards cannot be split into groups of {group_size}: N must be a multiple of "
            f"group_size (e.g. {hint}); groups are contiguous runs of group_size sequences"
        )
    check_finite("rewards", rewards)
    return rewards.reshape(num // group_size, group_size)


@ADVANTAGE_ESTIMATORS.register("grpo", doc="GRPO: (r - group mean) / (group std + eps)")
@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    unbiased_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """[N] GRPO (Shao et al. 2024): ``(r - mean_group) / (std_group + eps)``.

    ``normalize_std=False`` is Dr. GRPO's ``r - mean_group``. ``unbiased_std`` uses the
    sample std (divide by G-1, as DeepSeekMath/TRL); groups with all-equal rewards get 0.
    """
    groups = _grouped(rewards, group_size).to(torch.promote_types(rewards.dtype, torch.float32))
    centered = groups - groups.mean(dim=1, keepdim=True)
    constant = groups.amax(dim=1) == groups.amin(dim=1)
    if normalize_std:
        if group_size > 1:
            std = groups.std(dim=1, correction=1 if unbiased_std else 0, keepdim=True)
            centered = centered / (std + eps)
    centered[constant] = 0.0
    return centered.reshape(-1)


@ADVANTAGE_ESTIMATORS.register(
    "dr_grpo", doc="Dr. GRPO: r - group mean (verl: grpo with norm_adv_by_std_in_grpo=False)"
)
def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] Dr. GRPO (Liu et al. 2025): ``r - mean_group`` (no std division; 0 for all-equal groups)."""
    return grpo_advantages(rewards, group_size, normalize_std=False)


@ADVANTAGE_ESTIMATORS.register("rloo", doc="RLOO: r_i - mean of the other samples of the group")
@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] RLOO (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j`` within each group (G >= 2)."""
    groups = _grouped(rewards, group_size, min_size=2).to(torch.promote_types(rewards.dtype, torch.float32))
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    out = groups - others
    out[groups.amax(dim=1) == groups.amin(dim=1)] = 0.0
    return out.reshape(-1)


# ------------------------------------------------------------------ REINFORCE++
@torch.no_grad()
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k1",
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """[T] REINFORCE++ (Hu et al. 2025): KL-shaped token rewards, discounted returns, batch whitening.

    Token reward ``r_t = -kl_coef * KL_k(behav || ref)_t``, plus the sequence reward on the
    last target token; ``A_t = whiten(sum_{j >= t} gamma^(j-t) r_j)`` over all target tokens
    of the batch. ``logprobs`` are the behaviour (rollout) log-probs.
    """
    num_tokens = loss_mask.numel()
    check_cu_seqlens(cu_seqlens, num_tokens)
    if rewards.dim() != 1 or rewards.numel() != cu_seqlens.numel() - 1:
        raise ValueError(
            f"rewards must be [N] with N={cu_seqlens.numel() - 1} sequences, got shape {tuple(rewards.shape)}"
        )
    check_finite("rewards", rewards)
    per_token = token_rewards(rewards, loss_mask, cu_seqlens)
    if kl_coef != 0.0:
        if logprobs is None or ref_logprobs is None:
            raise ValueError(f"kl_coef={kl_coef} needs both logprobs (behaviour) and ref_logprobs")
        check_tokens("logprobs", logprobs, num_tokens)
        check_tokens("ref_logprobs", ref_logprobs, num_tokens)
        mask = loss_mask != 0
        zero = per_token.new_zeros(())
        lp = torch.where(mask, logprobs.to(per_token.dtype), zero)
        ref = torch.where(mask, ref_logprobs.to(per_token.dtype), zero)
        check_finite("logprobs", lp, mask)
        check_finite("ref_logprobs", ref, mask)
        per_token = per_token - kl_coef * torch.where(mask, kl_estimate(lp, ref, kl_estimator), zero)
    returns = discounted_returns(per_token, loss_mask, cu_seqlens, gamma=gamma)
    return whiten(returns, loss_mask, eps=eps)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_size: int,
    *,
    logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k1",
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """[T] REINFORCE++-baseline: rewards minus their group mean, then `reinforce_pp_advantages`."""
    return reinforce_pp_advantages(
        dr_grpo_advantages(rewards, group_size),
        loss_mask,
        cu_seqlens,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        gamma=gamma,
        eps=eps,
    )


# ------------------------------------------------------------------ REINFORCE++, outcome (group-level) form
def _weighted_whiten(values: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    picked = weights > 0
    out = torch.zeros_like(values)
    if not bool(picked.any()) or bool(values[picked].max() == values[picked].min()):
        return out
    w = weights.to(values.dtype)
    mean = (w * values).sum() / w.sum()
    std = ((w * (values - mean).square()).sum() / w.sum()).sqrt()
    out[picked] = ((values - mean) / (std + eps))[picked]
    return out


def _lengths(response_lengths: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if response_lengths is None:
        return torch.ones_like(like)
    if response_lengths.shape != like.shape:
        raise ValueError(f"response_lengths must be [N]={tuple(like.shape)}, got {tuple(response_lengths.shape)}")
    return response_lengths.to(like.dtype)


@ADVANTAGE_ESTIMATORS.register(
    "reinforce_plus_plus", doc="REINFORCE++ on outcome rewards: rewards whitened over the batch's response tokens"
)
@torch.no_grad()
def reinforce_pp_outcome_advantages(
    rewards: torch.Tensor, group_size: int, *, response_lengths: torch.Tensor | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """[N] REINFORCE++ with outcome rewards only (gamma 1, no KL term): ``whiten(r)`` over the batch.

    With ``response_lengths`` (the GRPO trainer passes them) the mean and (population) std are
    taken over target *tokens*, as verl and `reinforce_pp_advantages` do: sequence i counts
    ``|y_i|`` times. Without them each sequence counts once. All-equal rewards give 0.
    ``group_size`` only checks the batch shape (there is no group baseline).
    """
    flat = _grouped(rewards, group_size).reshape(-1).to(torch.promote_types(rewards.dtype, torch.float32))
    return _weighted_whiten(flat, _lengths(response_lengths, flat), eps)


@ADVANTAGE_ESTIMATORS.register(
    "reinforce_plus_plus_baseline",
    doc="REINFORCE++-baseline on outcome rewards: r - group mean, whitened over the batch's response tokens",
)
def reinforce_pp_outcome_baseline_advantages(
    rewards: torch.Tensor, group_size: int, *, response_lengths: torch.Tensor | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """[N] REINFORCE++-baseline, outcome form: ``whiten(r - mean_group)`` (token-weighted with ``response_lengths``)."""
    centered = dr_grpo_advantages(rewards, group_size)
    return reinforce_pp_outcome_advantages(centered, group_size, response_lengths=response_lengths, eps=eps)


# ------------------------------------------------------------------ OPO, pass@k, ReMax
@ADVANTAGE_ESTIMATORS.register("opo", doc="OPO: r - length-weighted group mean (optimal baseline)")
@torch.no_grad()
def opo_advantages(rewards: torch.Tensor, group_size: int, *, response_lengths: torch.Tensor) -> torch.Tensor:
    """[N] OPO (Hao et al. 2025): ``r_i - sum_j |y_j| r_j / sum_j |y_j|`` within each group.

    The length-weighted mean is the variance-minimising baseline for a sequence-sum loss. All-equal
    groups (incl. G = 1) give 0 (verl uses baseline 0 for a single sample). A group whose responses are
    all empty uses the plain mean.
    """
    groups = _grouped(rewards, group_size).to(torch.promote_types(rewards.dtype, torch.float32))
    lengths = _lengths(response_lengths, rewards).to(groups.dtype).reshape(groups.shape)
    total = lengths.sum(dim=1, keepdim=True)
    weighted = (lengths * groups).sum(dim=1, keepdim=True) / total.clamp(min=1e-12)
    baseline = torch.where(total > 0, weighted, groups.mean(dim=1, keepdim=True))
    out = groups - baseline
    out[groups.amax(dim=1) == groups.amin(dim=1)] = 0.0
    return out.reshape(-1)


@ADVANTAGE_ESTIMATORS.register("grpo_passk", doc="GRPO for pass@k: only each group's best sample, (r1 - r2) / std")
@torch.no_grad()
def grpo_passk_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """[N] pass@k GRPO (Chen et al. 2025, arXiv 2503.19595, as verl's grpo_passk).

    In each group only the best sample gets an advantage, ``(r_max - r_second) / (std_group + eps)``
    (sample std; without it when ``normalize_std=False``); every other sample gets 0. Ties give 0.
    """
    groups = _grouped(rewards, group_size, min_size=2).to(torch.promote_types(rewards.dtype, torch.float32))
    top, index = torch.topk(groups, 2, dim=1)
    gap = top[:, 0] - top[:, 1]
    if normalize_std:
        gap = gap / (groups.std(dim=1, correction=1) + eps)
    out = torch.zeros_like(groups)
    out.scatter_(1, index[:, :1], gap.unsqueeze(1))
    return out.reshape(-1)


@ADVANTAGE_ESTIMATORS.register("remax", doc="ReMax: r - reward of the prompt's greedy response")
@torch.no_grad()
def remax_advantages(rewards: torch.Tensor, group_size: int, *, baseline_rewards: torch.Tensor) -> torch.Tensor:
    """[N] ReMax (Li et al. 2024): ``r_i - b_k`` with ``b_k`` the reward of prompt k's greedy response.

    ``baseline_rewards`` is [N / group_size] (one greedy rollout per prompt, in group order).
    """
    groups = _grouped(rewards, group_size).to(torch.promote_types(rewards.dtype, torch.float32))
    if baseline_rewards.dim() != 1 or baseline_rewards.numel() != groups.shape[0]:
        raise ValueError(
            f"baseline_rewards must be [{groups.shape[0]}] (one greedy reward per prompt), "
            f"got shape {tuple(baseline_rewards.shape)}"
        )
    check_finite("baseline_rewards", baseline_rewards)
    return (groups - baseline_rewards.to(groups.dtype).unsqueeze(1)).reshape(-1)


AdvantageEstimator = str
"""An outcome estimator's name in `ADVANTAGE_ESTIMATORS` (grpo, dr_grpo, rloo, reinforce_plus_plus,
reinforce_plus_plus_baseline, a user's) or its import path ``"package.module:function"``."""


def group_advantages(
    rewards: torch.Tensor, group_size: int, estimator: AdvantageEstimator, **context: torch.Tensor | None
) -> torch.Tensor:
    """[N] per-sequence advantages of consecutive groups of ``group_size`` samples.

    ``estimator`` names an outcome estimator ``fn(rewards [N], group_size, **needs) -> [N]`` in
    `ADVANTAGE_ESTIMATORS` (an unknown name raises ValueError listing the registered ones).
    ``context`` holds what some estimators need (``response_lengths`` [N] for opo and the
    token-weighted REINFORCE++, ``baseline_rewards`` [N/G] for remax); each estimator receives the
    entries its signature names, and a required one that is missing is a ValueError.
    """
    if estimator == "gae":
        raise ValueError("advantage estimator 'gae' needs a critic's values: use the ppo trainer")
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in context.items() if k in params and v is not None}
    missing = [
        name for name, p in params.items() if p.kind is p.KEYWORD_ONLY and p.default is p.empty and name not in kwargs
    ]
    if missing:
        raise ValueError(
            f"advantage estimator {estimator!r} needs {missing}, which this trainer does not provide "
            f"(it provides {sorted(k for k, v in context.items() if v is not None)})"
        )
    advantages: torch.Tensor = fn(rewards, group_size, **kwargs)
    return advantages
