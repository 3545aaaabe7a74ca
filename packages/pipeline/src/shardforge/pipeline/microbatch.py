"""Packed micro-batches of one static shape, stacked for a pipeline schedule.

Legend: M = micro-batches, L = the fixed token length of every micro-batch, S = the fixed
length of every ``cu_seqlens`` row. Each micro-batch is a packed row of sequences
(``input_ids`` [T], ``position_ids`` [T], ``cu_seqlens`` [N+1]) with T <= L. It is padded to
L with one extra *padding sequence* (token ``pad_id``, positions 0..L-T-1), so packed
attention never mixes padding with real tokens; its ``cu_seqlens`` row is padded to S by
repeating L (empty sequences). Give padding zero loss weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["StackedMicrobatches", "stack_packed_microbatches", "trim_cu_seqlens"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StackedMicrobatches:
    """M packed micro-batches padded to one shape."""

    input_ids: torch.Tensor
    """[M, L] int64."""
    position_ids: torch.Tensor
    """[M, L] int64, restarting at 0 for every sequence (and for the padding sequence)."""
    cu_seqlens: torch.Tensor
    """[M, S] int32 sequence boundaries, padded by repeating L."""
    num_tokens: tuple[int, ...]
    """Real (unpadded) tokens of each micro-batch."""


def stack_packed_microbatches(
    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    seq_len: int,
    *,
    pad_id: int = 0,
) -> StackedMicrobatches:
    """Pad each ``(input_ids, position_ids, cu_seqlens)`` micro-batch to ``seq_len`` tokens and stack."""
    if not microbatches:
        raise ValueError("need at least one micro-batch")
    lengths = [int(ids.numel()) for ids, _, _ in microbatches]
    if max(lengths) > seq_len:
        raise ValueError(
            f"a micro-batch has {max(lengths)} tokens, more than the pipeline's static length {seq_len}; "
            f"raise the micro-batch token length to >= {max(lengths)}"
        )
    width = max(int(cu.numel()) for _, _, cu in microbatches) + 1  # + the padding sequence
    ids_rows, pos_rows, cu_rows = [], [], []
    for (ids, pos, cu), n in zip(microbatches, lengths, strict=True):
        pad = seq_len - n
        ids_rows.append(torch.cat([ids.long(), torch.full((pad,), pad_id, dtype=torch.long)]))
        pos_rows.append(torch.cat([pos.long(), torch.arange(pad, dtype=torch.long)]))
        cu = cu.to(torch.int32)
        row = torch.full((width,), seq_len, dtype=torch.int32)
        row[: cu.numel()] = cu
        cu_rows.append(row)
    return StackedMicrobatches(
        input_ids=torch.stack(ids_rows),
        position_ids=torch.stack(pos_rows),
        cu_seqlens=torch.stack(cu_rows),
        num_tokens=tuple(lengths),
    )


def trim_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """A padded ``cu_seqlens`` row ([S] or [1, S]) without its trailing empty sequences."""
    row = cu_seqlens.reshape(-1)
    total = row[-1]
    keep = int((row < total).sum().item()) + 1
    return row[:keep]
