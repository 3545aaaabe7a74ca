"""Input slicing and output gathering for context parallelism over packed batches.

The packed sequence (all sequences concatenated, length T) is padded to a multiple of
``multiple`` (cp, or cp * tp with sequence parallelism) and split into C contiguous
chunks; rank r of the CP group keeps chunk r. ``cu_seqlens`` stays global: attention runs
on the whole sequence after the Ulysses exchange. Targets (next tokens) are computed on
the full sequence *before* slicing, so a chunk's last token still knows its target.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_sequence", "pad_length", "slice_for_rank"]


def pad_length(num_tokens: int, multiple: int) -> int:
    """Tokens to append so ``num_tokens`` becomes a multiple of ``multiple``."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be >= 1")
    return (-num_tokens) % multiple


def slice_for_rank(x: torch.Tensor, rank: int, cp: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/cp chunk of ``x`` along ``dim`` (length must divide)."""
    if x.shape[dim] % cp != 0:
        raise ValueError(f"length {x.shape[dim]} along dim {dim} is not divisible by cp={cp}; pad first")
    return x.chunk(cp, dim=dim)[rank]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        local = local.contiguous()  # NCCL needs contiguous receive buffers; empty_like copies strides
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Every CP rank computes the same loss from the gathered tensor, so each rank's
        # share of the gradient is just its own chunk (summing would count it C times).
        rank = dist.get_rank(ctx.group)
        size = dist.get_world_size(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup | None, *, dim: int = 0) -> torch.Tensor:
    """All-gather per-token outputs (log-probs, entropy, values) from the CP ranks.

    Backward hands each rank the gradient of its own chunk: correct when every CP rank
    evaluates the same loss on the gathered result (how the engine uses it).
    """
    if group is None or dist.get_world_size(group) == 1:
        return local
    return _GatherSequence.apply(local, group, dim)  # type: ignore[no-any-return]
