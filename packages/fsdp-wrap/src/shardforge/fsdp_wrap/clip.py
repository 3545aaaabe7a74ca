"""Gradient-norm clipping that is correct for DTensor gradients on several meshes.

Each DTensor gradient's norm is reduced over the mesh its shards live on, so a parameter
replicated over some axis (e.g. a norm weight under TP) is counted once, not once per
replica. Parameters on different meshes (dense vs expert, or different PP stages) are
grouped and combined; with ``pp_mesh`` the per-stage totals are summed across stages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def total_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    *,
    norm_type: float = 2.0,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """The global gradient norm (a plain, replicated 0-dim float32 tensor)."""
    norm_type = float(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else ("local", grad.device)
        groups.setdefault(key, []).append(grad)
    partials: list[torch.Tensor] = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type, foreach=None)
        if isinstance(norm, DTensor):
            if math.isinf(norm_type):
                # The inf-norm is still Partial(max) here, and a max all-reduce may drop NaN (gloo
                # does): a NaN on one rank would vanish. Make it inf, which survives the max.
                local = norm.to_local()
                local = local.masked_fill(local.isnan(), math.inf)
                norm = DTensor.from_local(local, norm.device_mesh, norm.placements)
            norm = norm.full_tensor()
        partials.append(norm.float())
    if not partials:
        device = torch.device("cpu")
        total = torch.zeros((), device=device)
    elif math.isinf(norm_type):
        total = torch.stack(partials).max()
    else:
        total = torch.stack([p**norm_type for p in partials]).sum()
    if pp_mesh is not None and pp_mesh.size() > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        if math.isinf(norm_type):
            total = total.masked_fill(total.isnan(), math.inf)  # see above: max may drop NaN
        dist.all_reduce(total, op=op, group=pp_mesh.get_group())
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    return total


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip gradients in place to ``max_norm``; return the total norm before clipping.

    A non-finite norm leaves the gradients untouched and is returned as is, so the caller
    can skip the optimizer step (`torch.isfinite(norm)`).
    """
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type=norm_type, pp_mesh=pp_mesh)
    if not torch.isfinite(total):
        return total
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        for p in params:
            assert p.grad is not None
            p.grad.mul_(coef)
    return total
