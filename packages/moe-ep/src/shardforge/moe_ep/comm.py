"""Autograd-aware collectives used by expert parallelism.

Every function here is called by every rank of ``group`` in the same order, whatever the
number of tokens a rank holds (possibly zero): a rank with nothing to send still sends and
receives empty chunks, so no rank waits for a collective another rank skipped.

Legend: ``N`` rows (routed token copies), ``H`` hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_sum",
    "all_to_all_rows",
    "copy_to_group",
    "exchange_counts",
    "gather_rows",
    "split_rows",
]


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of an equal-sized integer tensor ``[P * k]``: row block j goes to rank j.

    Used before the token all-to-all so every rank knows how many rows it will receive
    from each peer (variable split sizes must be known on both sides).
    """
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        # The gradient travels back the way the rows came: the same exchange with splits swapped.
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all_rows(
    rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Send ``rows[sum(in_splits[:j]) : ...]`` to rank j; receive ``out_splits[j]`` rows from rank j.

    Differentiable: backward is the reverse all-to-all of the gradient.
    """
    return _AllToAllRows.apply(rows, out_splits, in_splits, group)  # type: ignore[no-any-return]


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # Partial sums -> replicated result: every rank's consumer holds the same full gradient
        # (the replicated-activation convention of tensor parallelism), so pass it through.
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum partial results over ``group`` (expert tensor parallelism); backward is the identity."""
    return _AllReduceSum.apply(x, group)  # type: ignore[no-any-return]


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``group`` (Megatron's ``f`` operator).

    Use on a replicated input consumed by rank-partial computations (expert TP): each rank's
    gradient is then only its partial contribution.
    """
    return _CopyToGroup.apply(x, group)  # type: ignore[no-any-return]


class _SplitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # The input was replicated: every rank must see the gradient of all rows.
        return _gather(grad, ctx.group), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # The output is replicated, so its gradient is the same full tensor on every rank:
        # each rank keeps the rows it produced.
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size)[rank].contiguous(), None


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def split_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's equal share of replicated rows (``x.shape[0]`` divisible by the group size)."""
    return _SplitRows.apply(x, group)  # type: ignore[no-any-return]


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's equal share back into the replicated rows (inverse of `split_rows`)."""
    return _GatherRows.apply(x, group)  # type: ignore[no-any-return]
