"""Per-sequence views of packed per-token tensors, and input checks shared by the RL functions.

Legend: T = packed tokens, N = sequences. ``cu_seqlens`` [N+1] holds sequence boundaries
(``0, len0, len0+len1, ..., T``); ``loss_mask`` [T] is non-zero where a token is a training
target (see `shardforge.algorithms.batch`). Every function here is a pure function of
tensors and never synchronises with the GPU in a loop over sequences.
"""

from __future__ import annotations

import torch

__all__ = [
    "broadcast_to_tokens",
    "check_cu_seqlens",
    "check_finite",
    "check_tokens",
    "last_target_index",
    "segment_ids",
    "segment_sum",
    "sequence_start_mask",
    "target_aligned_values",
    "target_counts",
]


def check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    """Raise `ValueError` unless ``cu_seqlens`` is a valid [N+1] boundary vector for T tokens."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1] with N >= 0, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != num_tokens:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at T={num_tokens} (the number of packed tokens), "
            f"got first={first} last={last}"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")


def check_tokens(name: str, tensor: torch.Tensor | None, num_tokens: int) -> None:
    """Raise `ValueError` unless ``tensor`` is None or a 1-D per-token tensor of T elements."""
    if tensor is not None and tuple(tensor.shape) != (num_tokens,):
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}; expected ({num_tokens},): one value per packed token, "
            "aligned like the log-probs (value t scores token t)"
        )


def check_finite(name: str, tensor: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Raise `ValueError` if ``tensor`` (restricted to ``where``) holds NaN or inf."""
    values = tensor if where is None else tensor[where]
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0]) if values.dim() == 1 else None
        raise ValueError(
            f"{name} holds {int(bad.sum())} non-finite value(s) (first at index {index} of the checked values); "
            "fix the source (e.g. a reward function returning NaN) instead of training on it"
        )


def segment_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] int64: the sequence index of every token."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(ids, lengths, output_size=num_tokens)


def segment_sum(values_T: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] sums of ``values_T`` over each sequence (differentiable)."""
    num_seqs = cu_seqlens.numel() - 1
    seg = segment_ids(cu_seqlens, values_T.numel())
    return values_T.new_zeros(num_seqs).index_add(0, seg, values_T)


def target_counts(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] float number of target tokens per sequence (the response length for RL)."""
    return segment_sum((loss_mask != 0).float(), cu_seqlens)


def broadcast_to_tokens(values_N: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T]: each sequence's value on its target tokens, 0 on every other token."""
    num_seqs = cu_seqlens.numel() - 1
    if tuple(values_N.shape) != (num_seqs,):
        raise ValueError(f"expected one value per sequence, shape ({num_seqs},), got {tuple(values_N.shape)}")
    seg = segment_ids(cu_seqlens, loss_mask.numel())
    return torch.where(loss_mask != 0, values_N[seg], values_N.new_zeros(()))


def last_target_index(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] int64 index (into T) of each sequence's last target token, -1 for a sequence without one."""
    num_tokens = loss_mask.numel()
    seg = segment_ids(cu_seqlens, num_tokens)
    positions = torch.arange(num_tokens, device=loss_mask.device)
    candidate = torch.where(loss_mask != 0, positions, torch.full_like(positions, -1))
    out = torch.full((cu_seqlens.numel() - 1,), -1, dtype=torch.long, device=loss_mask.device)
    return out.scatter_reduce(0, seg, candidate, reduce="amax")


def sequence_start_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] bool, True at the first token of every sequence."""
    starts = torch.zeros(num_tokens, dtype=torch.bool, device=cu_seqlens.device)
    first = cu_seqlens[:-1].long()
    starts[first[first < num_tokens]] = True
    return starts


def target_aligned_values(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] per-position values -> target-aligned: entry t is the value after tokens 0..t-1 (the
    state in which token t is chosen), 0 at sequence starts. Differentiable."""
    check_cu_seqlens(cu_seqlens, values.numel())
    shifted = torch.cat([values.new_zeros(1), values[:-1]])
    return shifted.masked_fill(sequence_start_mask(cu_seqlens, values.numel()), 0.0)
