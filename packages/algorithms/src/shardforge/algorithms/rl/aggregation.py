"""Loss aggregation modes written as per-token coefficients plus a normaliser.

The engine's contract (`shardforge.algorithms.engine`): a loss function returns a **sum**
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

L (``norm_length``) is a constant chosen by the user, Dr. GRPO uses the generation budget
(max new tokens), so the per-token weight does not depend on the response length.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from shardforge.algorithms.batching import segment_ids, target_counts

__all__ = ["LossAggregation", "aggregation_coefficients", "aggregation_weight", "check_aggregation"]

LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""How per-token losses are reduced to one number (see the module docstring)."""


def check_aggregation(mode: str, norm_length: float | None) -> None:
    """Raise `ValueError` for an unknown mode or a missing/invalid Dr. GRPO constant."""
    valid = get_args(LossAggregation)
    if mode not in valid:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {list(valid)}")
    if mode == "seq-mean-token-sum-norm" and (norm_length is None or not norm_length > 0):
        raise ValueError(
            "loss aggregation 'seq-mean-token-sum-norm' (Dr. GRPO) needs norm_length > 0, a constant such as "
            f"the maximum number of generated tokens; got norm_length={norm_length}"
        )


def aggregation_coefficients(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: LossAggregation,
    norm_length: float | None = None,
) -> torch.Tensor:
    """[T] float32 coefficients ``c_t`` (0 on non-target tokens) such that the micro-batch loss is ``sum(c * l)``."""
    check_aggregation(mode, norm_length)
    mask = (loss_mask != 0).float()
    if mode in ("token-mean", "seq-mean-token-sum"):
        return mask
    if mode == "seq-mean-token-sum-norm":
        assert norm_length is not None
        return mask / float(norm_length)
    counts = target_counts(loss_mask, cu_seqlens)
    per_token = counts[segment_ids(cu_seqlens, loss_mask.numel())]
    # clamp only protects non-target tokens of all-masked rows, whose mask is 0 anyway
    return mask / per_token.clamp(min=1.0)


def aggregation_weight(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: LossAggregation,
    norm_length: float | None = None,
) -> torch.Tensor:
    """0-dim float64 weight ``W`` of a micro-batch (summed over the global batch by the engine)."""
    check_aggregation(mode, norm_length)
    if mode == "token-mean":
        return (loss_mask != 0).sum().double()
    return (target_counts(loss_mask, cu_seqlens) > 0).sum().double()
