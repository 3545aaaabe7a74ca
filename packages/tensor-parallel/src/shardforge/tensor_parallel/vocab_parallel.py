"""Log-probs, entropy and cross-entropy on vocab-sharded logits, without gathering the vocab.

Legend: T = tokens, V = vocab, Vl = V / tp (this rank's slice), G = the TP group.

Each rank holds logits_TVl (columns [start, start + Vl) of the vocab). The softmax
normaliser needs two all-reduces over G (max, then sum of exp); the target's logit is
picked on the rank that owns it and summed over G. Backward needs no communication:
d logp_t / d logits = onehot(target) - softmax, computed on the local slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_entropy", "vocab_parallel_logprobs"]


def _local_and_group(logits: torch.Tensor) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """(local logits, TP group or None, first vocab index of the local slice)."""
    if not isinstance(logits, DTensor):
        return logits, None, 0
    placements = logits.placements
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim in (-1, logits.ndim - 1)]
    if len(shard_dims) != 1 or logits.device_mesh.ndim != 1:
        raise ValueError(
            f"expected logits sharded on the vocab dim over a 1-D TP mesh, got placements {placements} on "
            f"mesh dims {logits.device_mesh.mesh_dim_names}"
        )
    mesh = logits.device_mesh
    local = logits.to_local()
    vocab = logits.shape[-1]
    tp = mesh.size()
    if vocab % tp != 0:
        raise ValueError(f"vocab size {vocab} is not divisible by tp={tp}")
    start = mesh.get_local_rank() * (vocab // tp)
    return local, mesh.get_group(), start


def _softmax_stats(local: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(shifted local logits, log of the global sum of exp) with the global max subtracted."""
    maxima = local.max(dim=-1).values
    if group is not None:
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    shifted = local - maxima.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    if group is not None:
        dist.all_reduce(sum_exp, group=group)
    return shifted, sum_exp.log()


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, targets: torch.Tensor, group: Any, start: int) -> torch.Tensor:
        local = local.float()
        shifted, log_z = _softmax_stats(local, group)
        width = local.shape[-1]
        in_slice = (targets >= start) & (targets < start + width)
        index = (targets - start).clamp(0, width - 1)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * in_slice
        if group is not None:
            dist.all_reduce(picked, group=group)
        ctx.save_for_backward(shifted, log_z, index, in_slice)
        return picked - log_z

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        shifted, log_z, index, in_slice = ctx.saved_tensors
        softmax = (shifted - log_z.unsqueeze(-1)).exp()
        grad_local = -softmax * grad.unsqueeze(-1)
        onehot = torch.zeros_like(softmax).scatter_(-1, index.unsqueeze(-1), in_slice.unsqueeze(-1).to(softmax.dtype))
        grad_local = grad_local + onehot * grad.unsqueeze(-1)
        return grad_local, None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        local = local.float()
        shifted, log_z = _softmax_stats(local, group)
        softmax = (shifted - log_z.unsqueeze(-1)).exp()
        expected = (softmax * shifted).sum(dim=-1)
        if group is not None:
            dist.all_reduce(expected, group=group)
        entropy = log_z - expected
        ctx.save_for_backward(softmax, shifted, log_z, entropy)
        return entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # H = -sum p log p  =>  dH/dx_j = -p_j (log p_j + H), with log p_j = x_j - log Z.
        softmax, shifted, log_z, entropy = ctx.saved_tensors
        log_p = shifted - log_z.unsqueeze(-1)
        return -softmax * (log_p + entropy.unsqueeze(-1)) * grad.unsqueeze(-1), None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per row. ``logits`` [..., V] (a vocab-sharded DTensor or a plain
    tensor), ``targets`` [...] global vocab ids -> float32 [...], replicated on the TP ranks."""
    local, group, start = _local_and_group(logits)
    if targets.shape != local.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without vocab {tuple(local.shape[:-1])}"
        )
    return _LogProbs.apply(local, targets.to(local.device), group, start)  # type: ignore[no-any-return]


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per row (float32), without gathering the vocab."""
    local, group, _ = _local_and_group(logits)
    return _Entropy.apply(local, group)  # type: ignore[no-any-return]


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy (= -log-prob of the target); reduce it yourself (sum/mean/masked)."""
    return -vocab_parallel_logprobs(logits, targets)
