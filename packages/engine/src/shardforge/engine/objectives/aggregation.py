"""Loss aggregation modes written as per-token coefficients plus a normaliser.

The engine's contract (`shardforge.engine`): a loss function returns a **sum**
over one micro-batch, and the engine divides by a loss **weight** summed over the whole
global batch (all micro-batches, all data-parallel ranks). Micro-batches hold whole
sequences, so every aggregation below can be written as

    loss = sum_t c_t * l_t  /  W_global

with a per-token coefficient ``c_t`` that needs only the token's own sequence, and a
weight ``W`` that adds up over micro-batches. The result is then independent of how the
batch was split. With ``n_i`` the number of target tokens of sequence i and
``S = #{i : n_i > 0}`` (sequences with at least one target; all-masked rows count for
nothing in either the numerator or the denominator):

| mode | meaning | c_t (target t of seq i) | W |
|------|---------|-------------------------|---|
| ``token-mean`` | mean over all target tokens (DAPO, verl/AReaL default) | 1 | sum_i n_i |
| ``seq-mean-token-sum`` | per-sequence token sum, mean over sequences | 1 | S |
| ``seq-mean-token-mean`` | per-sequence token mean, mean over sequences (GRPO paper, GSPO) | 1 / n_i | S |
| ``seq-mean-token-sum-norm`` | token sum / a constant L, mean over sequences (Dr. GRPO) | 1 / L | S |
| ``token-sum`` | sum over all target tokens of the global batch, no normaliser | 1 | 1 (fixed) |

``token-sum`` is the one mode whose W is not a sum over micro-batches: it is the constant 1
(``Aggregation.fixed_weight``; the engine reads it from the loss function's ``fixed_loss_weight``).
Its gradient grows with the number of tokens in the batch, so the learning rate must be scaled to
the batch (e.g. lr / expected tokens per step); it is here for recipes written that way.

L (``norm_length``) is a constant chosen by the user, Dr. GRPO uses the generation budget
(max new tokens), so the per-token weight does not depend on the response length.

The modes are registered by name (verl's ``loss_agg_mode`` names) in `AGGREGATIONS`; add your
own with ``AGGREGATIONS.add("name", Aggregation(coefficients=..., weight=...))`` or name an
`Aggregation` by import path ``"package.module:attribute"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardforge.core.registry import Registry
from shardforge.engine.batching import segment_ids, target_counts

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "LossAggregation",
    "aggregation_coefficients",
    "aggregation_weight",
    "check_aggregation",
    "fixed_loss_weight",
]

LossAggregation = str
"""The name of a mode registered in `AGGREGATIONS` (see the module docstring)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Aggregation:
    """One loss aggregation mode: per-token coefficients and the micro-batch weight."""

    coefficients: Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]
    """``(loss_mask, cu_seqlens, norm_length) -> [T]`` float32 coefficients c_t (0 off the mask)."""
    weight: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``(loss_mask, cu_seqlens) -> 0-dim float64`` weight W of a micro-batch."""
    needs_norm_length: bool = False
    """Whether the mode divides by the user's constant ``norm_length`` (> 0)."""
    fixed_weight: float | None = None
    """A constant global W (``token-sum``: 1) used instead of the sum of ``weight`` over the batch."""


AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


def _mask(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, norm_length: float | None) -> torch.Tensor:
    return (loss_mask != 0).float()


def _per_length(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, norm_length: float | None) -> torch.Tensor:
    counts = target_counts(loss_mask, cu_seqlens)
    per_token = counts[segment_ids(cu_seqlens, loss_mask.numel())]
    # clamp only protects non-target tokens of all-masked rows, whose mask is 0 anyway
    return (loss_mask != 0).float() / per_token.clamp(min=1.0)


def _per_norm_length(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, norm_length: float | None) -> torch.Tensor:
    assert norm_length is not None
    return (loss_mask != 0).float() / float(norm_length)


def _tokens(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (loss_mask != 0).sum().double()


def _sequences(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (target_counts(loss_mask, cu_seqlens) > 0).sum().double()


AGGREGATIONS.add(
    "token-mean", Aggregation(coefficients=_mask, weight=_tokens), doc="mean over all target tokens (verl default)"
)
AGGREGATIONS.add(
    "seq-mean-token-sum",
    Aggregation(coefficients=_mask, weight=_sequences),
    doc="per-sequence token sum, mean over sequences",
)
AGGREGATIONS.add(
    "seq-mean-token-mean",
    Aggregation(coefficients=_per_length, weight=_sequences),
    doc="per-sequence token mean, mean over sequences (GRPO paper, GSPO)",
)
AGGREGATIONS.add(
    "seq-mean-token-sum-norm",
    Aggregation(coefficients=_per_norm_length, weight=_sequences, needs_norm_length=True),
    doc="token sum / constant norm_length, mean over sequences (Dr. GRPO)",
)

AGGREGATIONS.add(
    "token-sum",
    Aggregation(coefficients=_mask, weight=_tokens, fixed_weight=1.0),
    doc="sum over all target tokens of the global batch, no normaliser (scale lr to the batch)",
)


def _lookup(mode: str) -> Aggregation:
    try:
        found = AGGREGATIONS.get(mode)
    except ValueError as err:
        raise ValueError(f"unknown loss aggregation {mode!r}; registered: {AGGREGATIONS.names()}") from err
    if not isinstance(found, Aggregation):
        raise ValueError(f"loss aggregation {mode!r} is a {type(found).__name__}, not an Aggregation")
    return found


def check_aggregation(mode: str, norm_length: float | None) -> None:
    """Raise `ValueError` for an unknown mode or a missing/invalid Dr. GRPO constant."""
    if _lookup(mode).needs_norm_length and (norm_length is None or not norm_length > 0):
        raise ValueError(
            f"loss aggregation {mode!r} (Dr. GRPO) needs norm_length > 0, a constant such as "
            f"the maximum number of generated tokens; got norm_length={norm_length}"
        )


def fixed_loss_weight(mode: LossAggregation) -> float | None:
    """The mode's constant global weight (``token-sum``: 1.0), None when W is summed over the batch."""
    return _lookup(mode).fixed_weight


def aggregation_coefficients(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: LossAggregation,
    norm_length: float | None = None,
) -> torch.Tensor:
    """[T] float32 coefficients ``c_t`` (0 on non-target tokens) such that the micro-batch loss is ``sum(c * l)``."""
    check_aggregation(mode, norm_length)
    return _lookup(mode).coefficients(loss_mask, cu_seqlens, norm_length)


def aggregation_weight(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: LossAggregation,
    norm_length: float | None = None,
) -> torch.Tensor:
    """0-dim float64 weight ``W`` of a micro-batch (summed over the global batch by the engine)."""
    check_aggregation(mode, norm_length)
    return _lookup(mode).weight(loss_mask, cu_seqlens)
