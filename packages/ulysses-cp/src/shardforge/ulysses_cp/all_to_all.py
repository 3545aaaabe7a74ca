"""Ulysses all-to-all: switch a tensor between sequence sharding and head sharding.

Legend: T = packed tokens (global), H = heads on this rank before the exchange, D = head
dim, C = context-parallel size. Rank r holds tokens [r*T/C, (r+1)*T/C).

    seq_to_head:  [T/C, H, D]  ->  [T, H/C, D]   (before attention: whole sequence, some heads)
    head_to_seq:  [T, H/C, D]  ->  [T/C, H, D]   (after attention: back to sequence shards)

Each is one `all_to_all_single`; the backward of one is the other (DeepSpeed-Ulysses,
Jacobs et al. 2023).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["head_to_seq", "seq_to_head"]


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # Contiguous first: empty_like would copy a transposed view's strides, and the
    # collective writes the output buffer in plain row-major order.
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x_SHD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    cp = dist.get_world_size(group)
    s, h, d = x_SHD.shape
    if h % cp != 0:
        raise ValueError(f"heads on this rank ({h}) must be divisible by cp={cp} for the Ulysses exchange")
    # Chunk c of the heads goes to rank c; what arrives from rank c is sequence chunk c.
    send_CSHD = x_SHD.reshape(s, cp, h // cp, d).transpose(0, 1)
    recv_CSHD = _exchange(send_CSHD, group)
    return recv_CSHD.reshape(cp * s, h // cp, d)


def _head_to_seq(x_THD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    cp = dist.get_world_size(group)
    t, h, d = x_THD.shape
    if t % cp != 0:
        raise ValueError(f"sequence length {t} must be divisible by cp={cp}")
    # Sequence chunk c goes to rank c; what arrives from rank c is head chunk c.
    send_CSHD = x_THD.reshape(cp, t // cp, h, d)
    recv_CSHD = _exchange(send_CSHD, group)
    return recv_CSHD.transpose(0, 1).reshape(t // cp, cp * h, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_head(grad, ctx.group), None


def seq_to_head(x_SHD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[T/C, H, D] sequence shard -> [T, H/C, D] head shard (autograd-aware)."""
    return _SeqToHead.apply(x_SHD, group)  # type: ignore[no-any-return]


def head_to_seq(x_THD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[T, H/C, D] head shard -> [T/C, H, D] sequence shard (autograd-aware)."""
    return _HeadToSeq.apply(x_THD, group)  # type: ignore[no-any-return]
