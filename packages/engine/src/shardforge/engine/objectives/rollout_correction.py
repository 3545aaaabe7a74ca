"""Rollout correction: importance weights between the trainer's and the rollout engine's log-probs.

Legend: T = packed tokens, N = sequences. The rollout engine samples with the *behaviour* policy
(its own kernels, precision, weights version); the trainer recomputes the same tokens'
log-probs with the *old* (proximal) policy that anchors the PPO ratio. They differ (bf16 vs
fp32, vLLM vs HF kernels, MoE routing, stale weights in async mode), and training on the
engine's samples as if the trainer had drawn them biases the gradient and can collapse a run
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
Liu, Li et al. 2025, "When speed kills stability"). Per target token t:

    log rho_t = old_t - behav_t                      (clamped to [-20, 20])
    token:     rho_t                                 per token
    sequence:  rho_i = exp(sum_{t in i} log rho_t)   product over the sequence, on each token of i
    geometric: rho_i = exp(mean_{t in i} log rho_t)  geometric mean, on each token of i

and a mode turns the ratio r (of its level) into the weight w that multiplies the policy-gradient
loss of the token (``ppo_actor_loss(is_weights=...)``):

    truncate ("*_tis"):  w = min(r, cap)                                   truncated IS
    mask     ("*_mis"):  w = r if low <= r <= high, else the token leaves the loss (rejected)

Rejected tokens are removed from the loss mask, so they leave the loss normaliser too (they were,
in effect, not sampled). ``batch_normalize`` divides the weights by their mean over the global
batch (tokens for the token level, sequences otherwise) so the mean weight is 1.

The modes are registered by name in `ROLLOUT_CORRECTIONS` (``"none"``, ``"bypass"``,
``"token_tis"``, ``"token_mis"``, ``"icepop"``, ``"seq_tis"``, ``"seq_mis"``, ``"geo_tis"``,
``"geo_mis"``); a user's is any object with the `RolloutCorrection` shape, registered with
``ROLLOUT_CORRECTIONS.add(name, obj)`` or named by ``"package.module:attr"``.
See docs/packages/algorithms-rollout-correction.md for the papers and the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from shardforge.core.registry import Registry
from shardforge.engine.batching import PackedBatch, check_cu_seqlens, check_tokens, segment_ids, segment_sum
from shardforge.engine.objectives.stats import summarize_stats
from shardforge.mesh.collectives import all_reduce_stats, all_reduce_sum

__all__ = [
    "BEHAVIOUR_LOGPROBS",
    "ROLLOUT_CORRECTIONS",
    "ROLLOUT_IS_WEIGHTS",
    "CorrectionTerms",
    "ISCorrection",
    "RolloutCorrection",
    "RolloutCorrectionConfig",
    "RolloutCorrectionOutput",
    "apply_rollout_correction",
    "behaviour_gap",
    "behaviour_kl",
    "correct_batch",
    "rollout_correction",
    "summarize_correction_stats",
]

BEHAVIOUR_LOGPROBS = "behaviour_logprobs"
"""[T] extra: the log-probs the rollout engine recorded when it sampled the tokens."""
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
"""[T] extra: the rollout-correction weight of every target token (the actor loss multiplies by it)."""

Level = Literal["token", "sequence", "geometric"]
Action = Literal["truncate", "mask", "none"]

# Same bound as the PPO ratio (objectives.ppo): exp(20) ~ 4.9e8, far beyond any useful weight.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutCorrectionConfig:
    """Which correction the RL trainers apply to every batch (fresh and stale alike)."""

    mode: str = "token_tis"
    """A name in `ROLLOUT_CORRECTIONS` (none, bypass, token_tis, token_mis, icepop, seq_tis, seq_mis,
    geo_tis, geo_mis) or "package.module:attr"."""
    cap: float | None = 2.0
    """Truncation cap (>= 1) of the *_tis modes: w = min(ratio, cap); None: no cap (plain IS)."""
    low: float | None = None
    """Lower edge of the kept band of the mask modes (>= 0); None: the mode's default (see the docs)."""
    high: float | None = None
    """Upper edge of the kept band of the mask modes (> low); None: the mode's default."""
    batch_normalize: bool = False
    """Divide the weights by their mean over the global batch (mean weight 1), after truncation/masking."""

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_CORRECTIONS:
            try:
                ROLLOUT_CORRECTIONS.get(self.mode)
            except ValueError as err:
                raise ValueError(
                    f"unknown rollout_correction.mode {self.mode!r}; registered: {ROLLOUT_CORRECTIONS.names()}"
                ) from err
        if self.cap is not None and not self.cap >= 1.0:
            raise ValueError(
                f"rollout_correction.cap must be >= 1 (verl/TIS use 2), or None for no cap; got {self.cap}"
            )
        if self.low is not None and self.low < 0:
            raise ValueError(f"rollout_correction.low must be >= 0 (a ratio); got {self.low}")
        low, high = self.band()
        if not high > low:
            raise ValueError(f"rollout_correction needs low < high; got low={low}, high={high}")

    def band(self) -> tuple[float, float]:
        """The (low, high) kept band: the configured edges, else the mode's defaults."""
        mode = ROLLOUT_CORRECTIONS.get(self.mode)
        default = getattr(mode, "default_band", (0.0, 2.0))
        return (default[0] if self.low is None else self.low, default[1] if self.high is None else self.high)


@dataclass(frozen=True, kw_only=True, slots=True)
class CorrectionTerms:
    """What a correction returns for one batch (all [T], target-aligned)."""

    weight: torch.Tensor
    """[T] float64 weight of every token (any value off the mask and on rejected tokens)."""
    keep: torch.Tensor
    """[T] bool: target tokens that stay in the loss."""
    truncated: torch.Tensor
    """[T] bool: target tokens whose weight the cap lowered."""
    per_sequence: bool
    """True when the weight is one value per sequence (batch normalisation averages over sequences)."""


class RolloutCorrection(Protocol):
    """A mode: ``terms = mode(log_ratio [T], loss_mask [T], cu_seqlens [N+1], config)``."""

    @property
    def recompute(self) -> bool:
        """Whether the trainer recomputes old log-probs (False: "bypass", the engine's are the old ones)."""
        ...

    def __call__(
        self,
        log_ratio: torch.Tensor,
        loss_mask: torch.Tensor,
        cu_seqlens: torch.Tensor,
        config: RolloutCorrectionConfig,
    ) -> CorrectionTerms: ...


ROLLOUT_CORRECTIONS: Registry[RolloutCorrection] = Registry("rollout correction")


def _level_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, level: Level
) -> torch.Tensor:
    if level == "token":
        return log_ratio
    seg = segment_ids(cu_seqlens, log_ratio.numel())
    total = segment_sum(torch.where(mask, log_ratio, log_ratio.new_zeros(())), cu_seqlens)
    if level == "geometric":
        total = total / segment_sum(mask.to(log_ratio.dtype), cu_seqlens).clamp(min=1.0)
    return total.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)[seg]


@dataclass(frozen=True, slots=True)
class ISCorrection:
    """Importance sampling at a ``level`` with an ``action`` (truncate at the cap, mask outside the band)."""

    level: Level
    action: Action
    default_band: tuple[float, float] = (0.0, 2.0)
    recompute: bool = True

    def __call__(
        self,
        log_ratio: torch.Tensor,
        loss_mask: torch.Tensor,
        cu_seqlens: torch.Tensor,
        config: RolloutCorrectionConfig,
    ) -> CorrectionTerms:
        mask = loss_mask != 0
        ratio = torch.exp(_level_log_ratio(log_ratio, mask, cu_seqlens, self.level))
        keep, truncated = mask, torch.zeros_like(mask)
        if self.action == "none":
            ratio = torch.ones_like(ratio)
        elif self.action == "truncate" and config.cap is not None:
            truncated = mask & (ratio > config.cap)
            ratio = ratio.clamp(max=config.cap)
        elif self.action == "mask":
            low, high = config.band()
            keep = mask & (ratio >= low) & (ratio <= high)
        return CorrectionTerms(weight=ratio, keep=keep, truncated=truncated, per_sequence=self.level != "token")


ROLLOUT_CORRECTIONS.add("none", ISCorrection("token", "none"), doc="no weight (metrics only): AReaL's default")
ROLLOUT_CORRECTIONS.add(
    "bypass",
    ISCorrection("token", "none", recompute=False),
    doc="no recomputation: the engine's log-probs are the old ones (the PPO clip bounds the mismatch)",
)
ROLLOUT_CORRECTIONS.add("token_tis", ISCorrection("token", "truncate"), doc="token truncated IS: min(rho_t, cap)")
ROLLOUT_CORRECTIONS.add(
    "token_mis", ISCorrection("token", "mask"), doc="token masked IS: rho_t, tokens outside [low, high] dropped"
)
ROLLOUT_CORRECTIONS.add(
    "icepop",
    ISCorrection("token", "mask", default_band=(0.5, 5.0)),
    doc="IcePop (Ring-1T): two-sided token mask, default band [0.5, 5]",
)
ROLLOUT_CORRECTIONS.add("seq_tis", ISCorrection("sequence", "truncate"), doc="sequence IS (product), truncated")
ROLLOUT_CORRECTIONS.add(
    "seq_mis",
    ISCorrection("sequence", "mask", default_band=(0.5, 2.0)),
    doc="sequence IS (product), sequences outside [low, high] dropped",
)
ROLLOUT_CORRECTIONS.add("geo_tis", ISCorrection("geometric", "truncate"), doc="sequence IS (geometric mean), truncated")
ROLLOUT_CORRECTIONS.add(
    "geo_mis",
    ISCorrection("geometric", "mask", default_band=(1.0 / 1.001, 1.001)),
    doc="sequence IS (geometric mean), sequences outside [low, high] dropped",
)


@dataclass(kw_only=True)
class RolloutCorrectionOutput:
    """The corrected batch's extras and the statistics (sums, see `summarize_correction_stats`)."""

    weights: torch.Tensor
    """[T] float32 weights, 0 off the new loss mask."""
    loss_mask: torch.Tensor
    """[T] the loss mask without the rejected tokens (same dtype as the input)."""
    stats: dict[str, torch.Tensor]
    """float64 0-dim sums / counts / extremes (all_reduce_stats-able)."""


def rollout_correction(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: RolloutCorrectionConfig | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> RolloutCorrectionOutput:
    """Weights, new loss mask and mismatch statistics of one rank's share of a batch.

    ``group``: the data-parallel group, for ``batch_normalize`` (the mean is over the global
    batch, so the result does not depend on the split); one collective, only then.

    Statistics (token sums unless named): ``num_tokens``, ``num_sequences``, ``kl_k1``
    (``behav - old``), ``kl_k3`` (``rho - 1 - log rho``: KL(behav || old) estimated on the
    engine's samples), ``log_ppl_gap`` (per-sequence sum of ``mean_t (behav - old)`` = the
    trainer's minus the engine's log-perplexity), ``weight`` (over kept tokens) and
    ``weight_max``, ``truncated_frac``, ``masked_frac``, ``seq_worst_ratio`` (per-sequence sum
    of ``exp(max_t |log rho_t|)``) and ``_max``, ``ratio_max`` / ``ratio_min`` (token rho).
    """
    config = config or RolloutCorrectionConfig()
    num_tokens = old_logprobs.numel()
    check_cu_seqlens(cu_seqlens, num_tokens)
    check_tokens("behaviour_logprobs", behaviour_logprobs, num_tokens)
    check_tokens("loss_mask", loss_mask, num_tokens)
    mask = loss_mask != 0
    zero = torch.zeros((), dtype=torch.float64, device=old_logprobs.device)
    diff = torch.where(mask, old_logprobs.double() - behaviour_logprobs.double(), zero)
    for name, tensor in (("old_logprobs", old_logprobs), ("behaviour_logprobs", behaviour_logprobs)):
        if not bool(torch.isfinite(tensor[mask]).all()):
            raise ValueError(f"{name} has non-finite values on target tokens; the rollout or the trainer is broken")
    log_ratio = diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    terms = ROLLOUT_CORRECTIONS.get(config.mode)(log_ratio, loss_mask, cu_seqlens, config)
    keep = terms.keep & mask
    weight = torch.where(keep, terms.weight.double(), zero)
    if config.batch_normalize:
        weight = _normalize(weight, keep, cu_seqlens, terms.per_sequence, group, device)

    counts = segment_sum(mask.double(), cu_seqlens)
    has_tokens = counts > 0
    rho = torch.exp(log_ratio)
    worst = torch.full_like(counts, -math.inf).scatter_reduce(
        0, segment_ids(cu_seqlens, num_tokens), torch.where(mask, log_ratio.abs(), zero), reduce="amax"
    )
    worst = torch.where(has_tokens, torch.exp(worst), zero)
    per_seq_gap = segment_sum(-log_ratio, cu_seqlens) / counts.clamp(min=1.0)

    def extreme(values: torch.Tensor, where: torch.Tensor, kind: str) -> torch.Tensor:
        picked = values[where]
        if picked.numel() == 0:
            return torch.tensor(-math.inf if kind == "max" else math.inf, dtype=torch.float64)
        return picked.max() if kind == "max" else picked.min()

    stats = {
        "num_tokens": mask.sum().double(),
        "num_sequences": has_tokens.sum().double(),
        "kl_k1": (-log_ratio).sum(),
        "kl_k3": torch.where(mask, rho - 1.0 - log_ratio, zero).sum(),
        "log_ppl_gap": per_seq_gap[has_tokens].sum(),
        "weight": weight.sum(),
        "weight_max": extreme(weight, keep, "max"),
        "truncated_frac": (terms.truncated & mask).sum().double(),
        "masked_frac": (mask & ~keep).sum().double(),
        "seq_worst_ratio": worst.sum(),
        "seq_worst_ratio_max": extreme(worst, has_tokens, "max"),
        "ratio_max": extreme(rho, mask, "max"),
        "ratio_min": extreme(rho, mask, "min"),
    }
    new_mask = torch.where(keep, loss_mask, torch.zeros_like(loss_mask))
    return RolloutCorrectionOutput(
        weights=weight.float(),
        loss_mask=new_mask,
        stats={k: v.detach().double().cpu() for k, v in stats.items()},
    )


def _normalize(
    weight: torch.Tensor,
    keep: torch.Tensor,
    cu_seqlens: torch.Tensor,
    per_sequence: bool,
    group: dist.ProcessGroup | None,
    device: torch.device | None,
) -> torch.Tensor:
    if per_sequence:  # one weight per sequence: average over the sequences that kept tokens
        kept = segment_sum(keep.double(), cu_seqlens)
        seq_weight = segment_sum(weight, cu_seqlens) / kept.clamp(min=1.0)
        total, count = float(seq_weight[kept > 0].sum()), float((kept > 0).sum())
    else:
        total, count = float(weight.sum()), float(keep.sum())
    total, count = all_reduce_sum(total, count, group=group, device=device)
    mean = total / count if count > 0 else 1.0
    return weight / mean if mean > 0 else weight


_SEQUENCE_STATS = ("log_ppl_gap", "seq_worst_ratio")


def summarize_correction_stats(stats: dict[str, torch.Tensor], prefix: str = "rollout_corr/") -> dict[str, float]:
    """Per-token means (per-sequence for ``log_ppl_gap`` / ``seq_worst_ratio``, per kept token for
    ``weight``), fractions and extremes as floats named ``prefix + name``."""
    token = {k: v for k, v in stats.items() if k not in _SEQUENCE_STATS and k != "weight"}
    seq = {k: stats[k] for k in (*_SEQUENCE_STATS, "num_sequences")}
    kept = {"weight": stats["weight"], "num_kept": stats["num_tokens"] - stats["masked_frac"]}
    out = summarize_stats(token) | summarize_stats(seq, per="num_sequences") | summarize_stats(kept, per="num_kept")
    return {f"{prefix}{k}": v for k, v in out.items() if k != "num_kept"}


def correct_batch(
    batch: PackedBatch,
    config: RolloutCorrectionConfig,
    *,
    old_key: str,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Correct ``batch`` in place: add ``ROLLOUT_IS_WEIGHTS`` from ``extras[old_key]`` vs
    ``extras[BEHAVIOUR_LOGPROBS]``, drop rejected tokens from ``loss_mask``; return this rank's raw statistics
    (sums and extremes: reduce them with the step's other statistics, then `summarize_correction_stats`).
    Collective over ``group`` only with ``batch_normalize``."""
    for key in (old_key, BEHAVIOUR_LOGPROBS):
        if key not in batch.extras:
            raise KeyError(f"rollout correction needs batch.extras[{key!r}]; the batch has {sorted(batch.extras)}")
    out = rollout_correction(
        batch.extras[old_key], batch.extras[BEHAVIOUR_LOGPROBS], batch.loss_mask, batch.cu_seqlens, config,
        group=group, device=device,
    )  # fmt: skip
    batch.extras[ROLLOUT_IS_WEIGHTS] = out.weights
    batch.loss_mask = out.loss_mask
    return out.stats


def apply_rollout_correction(
    batch: PackedBatch,
    config: RolloutCorrectionConfig,
    *,
    old_key: str,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """`correct_batch`, and the global (all-reduced over ``group``) statistics, summarised. Collective when
    ``group`` is given."""
    stats = correct_batch(batch, config, old_key=old_key, group=group, device=device)
    return summarize_correction_stats(all_reduce_stats(stats, group, device))


def behaviour_gap(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """This rank's ``{"behaviour_gap": sum |old - behav|, "num_tokens": target tokens}`` (float64 0-dim): summed over
    the data-parallel ranks, their ratio is `behaviour_kl`."""
    mask = loss_mask != 0
    gap = (old_logprobs.double() - behaviour_logprobs.double())[mask]
    return {"behaviour_gap": gap.abs().sum(), "num_tokens": torch.tensor(float(gap.numel()), dtype=torch.float64)}


def behaviour_kl(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> float:
    """Mean ``|old - behav|`` per target token over the global batch (all-reduced over ``group``, so
    it does not depend on how the batch is split; 0.0 without target tokens). Collective with a group."""
    local = behaviour_gap(old_logprobs, behaviour_logprobs, loss_mask)
    total, count = all_reduce_sum(local["behaviour_gap"], local["num_tokens"], group=group, device=device)
    return total / count if count > 0 else 0.0
