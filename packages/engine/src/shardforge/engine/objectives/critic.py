"""PPO critic (value) loss with value clipping, on packed sequences.

Per target token with value v (differentiable), old value v_old (from the rollout) and
return R (e.g. from `gae_advantages`):

    v_clip = v_old + clip(v - v_old, -eps, eps)
    l      = max(f(v - R), f(v_clip - R))        with value clipping (PPO2, OpenAI baselines)
    l      = f(v - R)                            without
    f(e)   = e^2 / 2  ("mse")  or  huber_delta(e) ("huber": e^2/2 for |e| <= d, d (|e| - d/2) beyond)

reduced with the same aggregation modes as the actor loss (``token-mean`` by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from shardforge.engine.batching import check_cu_seqlens, check_finite, check_tokens, target_counts
from shardforge.engine.objectives.aggregation import (
    LossAggregation,
    aggregation_coefficients,
    aggregation_weight,
    check_aggregation,
    fixed_loss_weight,
)
from shardforge.engine.objectives.stats import LossOutput

__all__ = ["PPOCriticConfig", "ValueLossType", "ppo_critic_loss"]

ValueLossType = Literal["mse", "huber"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOCriticConfig:
    """Options of `ppo_critic_loss`."""

    value_clip: float | None = 0.2
    """Clip range eps of v - v_old (> 0); None disables value clipping."""
    loss_type: ValueLossType = "mse"
    """"mse" (half squared error) or "huber"."""
    huber_delta: float = 1.0
    """Huber threshold d (> 0); used by "huber" only."""
    aggregation: LossAggregation = "token-mean"
    """How token losses are reduced; see `shardforge.engine.objectives.aggregation`."""
    norm_length: float | None = None
    """The constant of "seq-mean-token-sum-norm"."""

    def __post_init__(self) -> None:
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be > 0 (e.g. 0.2), or None to disable; got {self.value_clip}")
        if self.loss_type not in get_args(ValueLossType):
            raise ValueError(f"unknown loss_type {self.loss_type!r}; valid: {list(get_args(ValueLossType))}")
        if not self.huber_delta > 0:
            raise ValueError(f"huber_delta must be > 0; got {self.huber_delta}")
        check_aggregation(self.aggregation, self.norm_length)


def _error_loss(error: torch.Tensor, config: PPOCriticConfig) -> torch.Tensor:
    if config.loss_type == "mse":
        return 0.5 * error.square()
    return F.huber_loss(error, torch.zeros_like(error), reduction="none", delta=config.huber_delta)


def ppo_critic_loss(
    values: torch.Tensor,
    *,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: PPOCriticConfig | None = None,
) -> LossOutput:
    """The critic loss of one micro-batch: ``loss_sum`` plus token-sum stats ``value_loss``,
    ``value_clip_frac`` (tokens where the clipped error was the larger one), ``values``, ``returns``."""
    config = config or PPOCriticConfig()
    num_tokens = values.numel()
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D [T] (packed), got shape {tuple(values.shape)}")
    check_cu_seqlens(cu_seqlens, num_tokens)
    for name, tensor in (("old_values", old_values), ("returns", returns), ("loss_mask", loss_mask)):
        check_tokens(name, tensor, num_tokens)
    mask = loss_mask != 0
    zero = values.new_zeros(())
    old = torch.where(mask, old_values.detach().to(values.dtype), zero)
    ret = torch.where(mask, returns.detach().to(values.dtype), zero)
    check_finite("old_values", old, mask)
    check_finite("returns", ret, mask)
    val = torch.where(mask, values, zero)
    loss_unclipped = _error_loss(val - ret, config)
    if config.value_clip is not None:
        v_clipped = old + (val - old).clamp(-config.value_clip, config.value_clip)
        loss_clipped = _error_loss(v_clipped - ret, config)
        per_token = torch.maximum(loss_unclipped, loss_clipped)
        clipped = mask & (loss_clipped > loss_unclipped)
    else:
        per_token = loss_unclipped
        clipped = torch.zeros_like(mask)
    coeffs = aggregation_coefficients(loss_mask, cu_seqlens, config.aggregation, config.norm_length)
    loss_sum = (per_token * coeffs.to(per_token.dtype)).sum()
    weight = aggregation_weight(loss_mask, cu_seqlens, config.aggregation, config.norm_length)
    with torch.no_grad():
        fmask = mask.double()
        stats = {
            "num_tokens": fmask.sum(),
            "num_sequences": (target_counts(loss_mask, cu_seqlens) > 0).sum().double(),
            "loss_sum": loss_sum.detach().double(),
            "loss_weight": weight,
            "value_loss": (per_token.double() * fmask).sum(),
            "value_clip_frac": clipped.sum().double(),
            "values": (val.double() * fmask).sum(),
            "returns": (ret.double() * fmask).sum(),
        }
    if fixed_loss_weight(config.aggregation) is not None:  # token-sum: the engine's loss is the sum itself
        stats.pop("loss_weight")
    return LossOutput(loss_sum=loss_sum, loss_weight=weight, stats={k: v.cpu() for k, v in stats.items()})
