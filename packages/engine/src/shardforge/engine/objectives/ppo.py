"""PPO actor loss on packed sequences: clip, asymmetric clip, dual clip, decoupled PPO, GSPO ratios.

Legend: T = packed tokens, N = sequences. All per-token inputs are [T] and target-aligned
(value t scores token t, see `shardforge.engine.batching`); only tokens with a non-zero
``loss_mask`` count. Notation: ``pi`` the policy being trained (``logprobs``), ``prox`` the
proximal policy, ``behav`` the behaviour policy that sampled the tokens (``old_logprobs``).

Per target token t with advantage A (a *loss*, to minimise):

    r      = pi / prox                                  (token ratio; or the GSPO sequence ratio)
    l_clip = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))            Schulman et al. 2017; DAPO clip-higher
    l_pg   = min(l_clip, -c A)  if A < 0, else l_clip                    dual clip, Ye et al. 2020 (c > 1)
    l_pg  *= w = sg[prox / behav], capped                                decoupled PPO, Hilton et al. 2022 (AReaL)
    l      = l_pg - entropy_coef * H + kl_coef * KL_k(pi || ref)

and the micro-batch loss is ``sum_t c_t l_t`` with the aggregation coefficients of
`shardforge.engine.objectives.aggregation` (divided by the global weight by the engine).

Sequence-level ratios (GSPO, Zheng et al. 2025) use ``s_i = exp(mean_{t in i} log(pi/prox))``
in its GSPO-token form ``r_t = sg[s_i] * pi_t / sg[pi_t]``: the value of every token's ratio
is ``s_i`` (so clipping decisions are per sequence), and the gradient is ``s_i grad log pi_t``.
With per-sequence advantages and ``seq-mean-token-mean`` aggregation this is exactly GSPO's
gradient ``s_i A_i (1/|y_i|) sum_t grad log pi_t``.

The policy-gradient term ``l_pg`` (before the behaviour weight) is picked by name from
`POLICY_LOSSES` (verl's names): ``"vanilla"`` (PPO clip with clip-higher and dual clip; its
ratio follows ``ratio_level``) and ``"gspo"`` (the same clipping on the sequence ratio) here;
CISPO, GMPO, SAPO, Clip-Cov, KL-Cov, GPG and REINFORCE in `objectives.policy_losses`. Add
your own with ``@POLICY_LOSSES.register("name")`` on a `PolicyLossFn`, or set
``policy_loss="package.module:function"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

import torch

from shardforge.core.registry import Registry
from shardforge.engine.batching import (
    check_cu_seqlens,
    check_finite,
    check_tokens,
    segment_ids,
    segment_sum,
    target_counts,
)
from shardforge.engine.objectives.aggregation import (
    LossAggregation,
    aggregation_coefficients,
    aggregation_weight,
    check_aggregation,
    fixed_loss_weight,
)
from shardforge.engine.objectives.kl import KLEstimator, check_kl_estimator, kl_estimate
from shardforge.engine.objectives.policy_loss_options import ClipCovConfig, KLCovConfig, SAPOConfig
from shardforge.engine.objectives.stats import LossOutput

__all__ = [
    "POLICY_LOSSES",
    "BehaviourWeightMode",
    "PPOActorConfig",
    "PolicyLossFn",
    "PolicyLossTerms",
    "RatioLevel",
    "clip_policy_loss",
    "ppo_actor_loss",
]

RatioLevel = Literal["token", "sequence"]
BehaviourWeightMode = Literal["truncate", "mask"]

# exp(20) ~ 4.9e8: a log-ratio beyond this means the policy has moved absurdly far; clamping
# keeps the loss and (zero) gradients of clipped tokens finite instead of inf * 0 = NaN.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOActorConfig:
    """Options of `ppo_actor_loss`. Defaults: PPO with eps 0.2, token ratios, token-mean."""

    policy_loss: str = "vanilla"
    """Policy-gradient term, a name in `POLICY_LOSSES` ("vanilla", "gspo", "cispo", "geo_mean", "sapo", "clip_cov",
    "kl_cov", "gpg", "reinforce", "dppo_tv", "dppo_kl"; see objectives/policy_losses.py) or "package.module:function"."""
    clip_eps_low: float = 0.2
    """Lower clip range: ratios are clipped at 1 - clip_eps_low (0 < value < 1)."""
    clip_eps_high: float | None = None
    """Upper clip range 1 + clip_eps_high (DAPO "clip-higher", e.g. 0.28); None means clip_eps_low."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for A < 0 the loss is bounded by -c A (Ye et al. 2020); None disables."""
    ratio_level: RatioLevel = "token"
    """"token" (PPO/GRPO) or "sequence" (GSPO: geometric mean of the token ratios of a sequence)."""
    aggregation: LossAggregation = "token-mean"
    """How token losses are reduced; see `shardforge.engine.objectives.aggregation`."""
    norm_length: float | None = None
    """The constant L of "seq-mean-token-sum-norm" (Dr. GRPO), e.g. the max new tokens."""
    behav_weight_cap: float | None = None
    """Cap (>= 1) on the decoupled behaviour importance weight prox/behav; None: no cap."""
    behav_weight_mode: BehaviourWeightMode = "truncate"
    """Above the cap: "truncate" uses the cap (truncated IS, as verl's TIS) or "mask" drops the token (AReaL)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (>= 0); needs ``entropy`` when > 0."""
    kl_coef: float = 0.0
    """Coefficient (>= 0) of a KL(pi || ref) loss term (GRPO); needs ``ref_logprobs`` when > 0."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator of the loss term, a name in `KL_ESTIMATORS` ("k1", "k2", "k3", "abs", ...)."""
    clip_cov: ClipCovConfig = field(default_factory=ClipCovConfig)
    """policy_loss=clip_cov's options: ratio, lb, ub."""
    kl_cov: KLCovConfig = field(default_factory=KLCovConfig)
    """policy_loss=kl_cov's options: ratio, coef."""
    sapo: SAPOConfig = field(default_factory=SAPOConfig)
    """policy_loss=sapo's options: tau_pos, tau_neg."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "clip_cov_ratio": "clip_cov.ratio",
        "clip_cov_lb": "clip_cov.lb",
        "clip_cov_ub": "clip_cov.ub",
        "kl_cov_ratio": "kl_cov.ratio",
        "ppo_kl_coef": "kl_cov.coef",
        "sapo_tau_pos": "sapo.tau_pos",
        "sapo_tau_neg": "sapo.tau_neg",
    }

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            try:
                POLICY_LOSSES.get(self.policy_loss)
            except ValueError as err:
                raise ValueError(
                    f"unknown policy_loss {self.policy_loss!r}; registered: {POLICY_LOSSES.names()}"
                ) from err
        if not 0.0 < self.clip_eps_low < 1.0:
            raise ValueError(f"clip_eps_low must be in (0, 1) so that 1 - eps > 0; got {self.clip_eps_low}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0.0:
            raise ValueError(f"clip_eps_high must be > 0 (or None to reuse clip_eps_low); got {self.clip_eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (typically 3), or None to disable; got {self.dual_clip}")
        if self.ratio_level not in get_args(RatioLevel):
            raise ValueError(f"unknown ratio_level {self.ratio_level!r}; valid: {list(get_args(RatioLevel))}")
        check_aggregation(self.aggregation, self.norm_length)
        if self.behav_weight_cap is not None and not self.behav_weight_cap >= 1.0:
            raise ValueError(f"behav_weight_cap must be >= 1 (e.g. 5), or None; got {self.behav_weight_cap}")
        if self.behav_weight_mode not in get_args(BehaviourWeightMode):
            raise ValueError(
                f"unknown behav_weight_mode {self.behav_weight_mode!r}; valid: {list(get_args(BehaviourWeightMode))}"
            )
        if self.entropy_coef < 0 or self.kl_coef < 0:
            raise ValueError(f"entropy_coef and kl_coef must be >= 0; got {self.entropy_coef}, {self.kl_coef}")
        check_kl_estimator(self.kl_estimator)

    @property
    def eps_high(self) -> float:
        return self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLossTerms:
    """What a policy loss returns: the per-token loss and the clipping masks for the statistics."""

    pg: torch.Tensor
    """[T] policy-gradient loss per token (0 off the mask), before the behaviour weight."""
    ratio: torch.Tensor
    """[T] the (clamped) ratio pi / prox, for the statistics."""
    clipped: torch.Tensor
    """[T] bool: tokens whose loss the clip picked."""
    clipped_low: torch.Tensor
    """[T] bool: the clipped tokens below 1 - eps_low."""
    dual: torch.Tensor
    """[T] bool: tokens the dual clip bounded."""


PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "PPOActorConfig"], PolicyLossTerms
]
"""``fn(logprobs, prox_logprobs, advantages, loss_mask, cu_seqlens, config) -> PolicyLossTerms``.

All [T], off-mask values already zeroed; ``logprobs`` is differentiable, the rest are data."""

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def _sequence_log_ratio(
    lp: torch.Tensor, prox: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    mask = loss_mask != 0
    counts = target_counts(loss_mask, cu_seqlens)
    seq_log_ratio = segment_sum((lp - prox).detach(), cu_seqlens) / counts.clamp(min=1.0)
    seg = segment_ids(cu_seqlens, lp.numel())
    return torch.where(mask, lp - lp.detach() + seq_log_ratio[seg], lp.new_zeros(()))


def clip_policy_loss(
    log_ratio: torch.Tensor, adv: torch.Tensor, loss_mask: torch.Tensor, config: PPOActorConfig
) -> PolicyLossTerms:
    """PPO's clipped surrogate (clip-higher, dual clip) on a given log-ratio."""
    mask = loss_mask != 0
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    ratio_clipped = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.eps_high)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio_clipped
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = mask & (pg_clipped > pg_unclipped)
    if config.dual_clip is not None:
        pg_dual = -adv * config.dual_clip
        dual = mask & (adv < 0) & (pg_dual < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, pg_dual), pg)
    else:
        dual = torch.zeros_like(mask)
    low = clipped & (ratio < 1.0 - config.clip_eps_low)
    return PolicyLossTerms(pg=pg, ratio=ratio, clipped=clipped, clipped_low=low, dual=dual)


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """PPO clip (Schulman 2017) with clip-higher and dual clip; token or sequence ratio per ratio_level."""
    if config.ratio_level == "token":
        log_ratio = lp - prox
    else:
        log_ratio = _sequence_log_ratio(lp, prox, loss_mask, cu_seqlens)
    return clip_policy_loss(log_ratio, adv, loss_mask, config)


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    lp: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig,
) -> PolicyLossTerms:
    """GSPO (Zheng et al. 2025): PPO clipping on the geometric-mean sequence ratio, whatever ratio_level."""
    return clip_policy_loss(_sequence_log_ratio(lp, prox, loss_mask, cu_seqlens), adv, loss_mask, config)


def _extreme(values: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    picked = values[mask]
    if picked.numel() == 0:
        return torch.tensor(float("-inf") if kind == "max" else float("inf"), dtype=torch.float64)
    return (picked.max() if kind == "max" else picked.min()).double()


def ppo_actor_loss(
    logprobs: torch.Tensor,
    *,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOActorConfig | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """The PPO actor loss of one micro-batch (see the module docstring for the formula).

    Args:
        logprobs: [T] log-probs of the policy being trained (differentiable).
        old_logprobs: [T] behaviour log-probs (the policy that sampled the tokens).
        advantages: [T] per-token advantages (broadcast sequence advantages with
            `shardforge.engine.objectives.broadcast_to_tokens`).
        loss_mask: [T] non-zero on target tokens.
        cu_seqlens: [N+1] sequence boundaries.
        config: the options; `PPOActorConfig()` by default.
        proximal_logprobs: [T] proximal log-probs for decoupled PPO (recomputed with the
            weights before this update); None: the behaviour policy is the proximal one.
        ref_logprobs: [T] reference-model log-probs, for the KL loss term and the ``kl_ref`` stat.
        entropy: [T] policy entropy per position (differentiable), for the bonus and the stat.
        is_weights: [T] rollout-correction weights (data) multiplying the policy-gradient loss
            (`shardforge.engine.objectives.rollout_correction`); None: no correction.

    Returns:
        `LossOutput` with ``loss_sum`` (what an engine ``loss_fn`` returns), ``loss_weight``
        and token-sum statistics: ``pg_loss``, ``clip_frac`` (``clip_low_frac`` +
        ``clip_high_frac``), ``dual_clip_frac``, ``ratio`` / ``_max`` / ``_min``,
        ``approx_kl`` (k1) and ``approx_kl_k3`` of prox -> pi, ``advantages``, and when given
        ``entropy``, ``kl_ref``, ``behav_weight`` / ``_max`` / ``behav_capped_frac``.
    """
    config = config or PPOActorConfig()
    num_tokens = logprobs.numel()
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be 1-D [T] (packed), got shape {tuple(logprobs.shape)}")
    check_cu_seqlens(cu_seqlens, num_tokens)
    for name, tensor in (
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
        ("proximal_logprobs", proximal_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
        ("is_weights", is_weights),
    ):
        check_tokens(name, tensor, num_tokens)
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} > 0 needs the per-token entropy tensor")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={config.kl_coef} > 0 needs ref_logprobs (the reference model's log-probs)")

    mask = loss_mask != 0
    zero = logprobs.new_zeros(())

    def data(x: torch.Tensor) -> torch.Tensor:
        # Inputs other than logprobs/entropy are data; values off the mask are ignored (they
        # may be anything, e.g. 0 or -inf at prompt tokens), so replace them before any exp.
        return torch.where(mask, x.detach().to(logprobs.dtype), zero)

    old, adv = data(old_logprobs), data(advantages)
    prox = old if proximal_logprobs is None else data(proximal_logprobs)
    ref = None if ref_logprobs is None else data(ref_logprobs)
    for name, tensor in (("old_logprobs", old), ("advantages", adv), ("proximal_logprobs", prox)):
        check_finite(name, tensor, mask)
    check_finite("logprobs", logprobs.detach(), mask)
    lp = torch.where(mask, logprobs, zero)

    terms = POLICY_LOSSES.get(config.policy_loss)(lp, prox, adv, loss_mask, cu_seqlens, config)
    pg, ratio, clipped, dual = terms.pg, terms.ratio, terms.clipped, terms.dual

    behav_stats: dict[str, torch.Tensor] = {}
    if proximal_logprobs is not None:
        behav_weight = torch.exp((prox - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        capped = torch.zeros_like(mask)
        weight_max = _extreme(behav_weight, mask, "max")
        if config.behav_weight_cap is not None:
            capped = mask & (behav_weight > config.behav_weight_cap)
            if config.behav_weight_mode == "truncate":
                behav_weight = behav_weight.clamp(max=config.behav_weight_cap)
            else:
                behav_weight = torch.where(capped, zero, behav_weight)
        pg = pg * behav_weight
        behav_stats = {
            "behav_weight": (behav_weight * mask).sum().double(),
            "behav_weight_max": weight_max,
            "behav_capped_frac": capped.sum().double(),
        }

    if is_weights is not None:  # rollout correction: trainer vs engine mismatch (and staleness)
        pg = pg * data(is_weights)

    per_token = pg
    if entropy is not None and config.entropy_coef > 0:
        per_token = per_token - config.entropy_coef * torch.where(mask, entropy, zero)
    kl_ref = None
    if ref is not None:
        kl_ref = kl_estimate(lp, ref, config.kl_estimator)
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl_ref

    coeffs = aggregation_coefficients(loss_mask, cu_seqlens, config.aggregation, config.norm_length)
    loss_sum = (per_token * coeffs.to(per_token.dtype)).sum()
    weight = aggregation_weight(loss_mask, cu_seqlens, config.aggregation, config.norm_length)

    with torch.no_grad():
        fmask = mask.double()
        low = terms.clipped_low
        stats = {
            "num_tokens": fmask.sum(),
            "num_sequences": (target_counts(loss_mask, cu_seqlens) > 0).sum().double(),
            "loss_sum": loss_sum.detach().double(),
            "loss_weight": weight,
            "pg_loss": (pg.double() * fmask).sum(),
            "clip_frac": clipped.sum().double(),
            "clip_low_frac": low.sum().double(),
            "clip_high_frac": (clipped & ~low).sum().double(),
            "dual_clip_frac": dual.sum().double(),
            "ratio": (ratio.double() * fmask).sum(),
            "ratio_max": _extreme(ratio, mask, "max"),
            "ratio_min": _extreme(ratio, mask, "min"),
            "approx_kl": ((prox - lp).double() * fmask).sum(),
            "approx_kl_k3": (kl_estimate(lp, prox, "k3").double() * fmask).sum(),
            "advantages": (adv.double() * fmask).sum(),
            **behav_stats,
        }
        if entropy is not None:
            stats["entropy"] = (entropy.detach().double() * fmask).sum()
        if kl_ref is not None:
            stats["kl_ref"] = (kl_ref.detach().double() * fmask).sum()
    if fixed_loss_weight(config.aggregation) is not None:  # token-sum: the engine's loss is the sum itself
        stats.pop("loss_weight")
    return LossOutput(loss_sum=loss_sum, loss_weight=weight, stats={k: v.cpu() for k, v in stats.items()})
