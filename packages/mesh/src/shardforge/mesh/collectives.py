"""THE place that all-reduces scalars and statistics across ranks.

One device rule for every collective of a few numbers: the tensors go to the device the
process group's backend needs (``device``; NCCL takes CUDA tensors only, gloo takes CPU
tensors), and come back to the host as plain floats / CPU tensors. Callers pass the engine's
device (`TrainEngine.device`); ``None`` means "the backend's default device for ``group``".

Statistics are reduced by name (see `shardforge.engine.objectives.stats`): ``*_max`` with
MAX, ``*_min`` with MIN, everything else summed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_max",
    "all_reduce_stats",
    "all_reduce_sum",
    "backend_device",
    "broadcast_floats",
    "reduce_stats_once",
    "stat_kind",
]


def backend_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a collective over ``group`` needs its tensors on (CUDA for NCCL, else CPU)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack(values: Sequence[torch.Tensor | float | int], device: torch.device | None, group: object) -> torch.Tensor:
    packed = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return packed.to(device if device is not None else backend_device(group))  # type: ignore[arg-type]


def _reduce(
    values: Sequence[torch.Tensor | float | int],
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None,
    device: torch.device | None,
) -> list[float]:
    if group is None or not dist.is_initialized():
        return [float(v) for v in values]
    packed = _pack(values, device, group)
    dist.all_reduce(packed, op=op, group=group)
    return packed.cpu().tolist()  # type: ignore[no-any-return]


def all_reduce_sum(
    *values: torch.Tensor | float | int,
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
) -> list[float]:
    """Sum scalars over ``group`` in one float64 collective; identity without a group.

    ``group=None`` means "nothing to reduce over" (e.g. an engine with no data-parallel axis),
    never the default group: pass ``dist.group.WORLD`` for that."""
    return _reduce(values, dist.ReduceOp.SUM, group, device)


def all_reduce_max(
    *values: torch.Tensor | float | int,
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
) -> list[float]:
    """Element-wise max of scalars over ``group`` (one collective); identity without a group."""
    return _reduce(values, dist.ReduceOp.MAX, group, device)


def broadcast_floats(
    *values: float, src: int, group: dist.ProcessGroup | None, device: torch.device | None = None
) -> list[float]:
    """Global rank ``src``'s values on every rank of ``group`` (one collective); identity without a group."""
    if group is None or not dist.is_initialized():
        return [float(v) for v in values]
    packed = _pack(values, device, group)
    dist.broadcast(packed, src=src, group=group)
    return packed.cpu().tolist()  # type: ignore[no-any-return]


def stat_kind(name: str) -> str:
    """How statistic ``name`` reduces: "max", "min" or "sum"."""
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "sum"


def all_reduce_stats(
    stats: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Reduce merged statistics over ``group`` by name (at most three collectives: sum, max, min).

    Every rank must pass the same keys. Returns float64 0-dim CPU tensors; identity without a group."""
    local = {k: v.detach().double().reshape(()).cpu() for k, v in stats.items()}
    if group is None or not dist.is_initialized():
        return local
    names = sorted(local)
    target = device if device is not None else backend_device(group)
    out: dict[str, torch.Tensor] = {}
    for kind, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        keys = [n for n in names if stat_kind(n) == kind]
        if not keys:
            continue
        packed = torch.stack([local[k] for k in keys]).to(target)
        dist.all_reduce(packed, op=op, group=group)
        out.update(zip(keys, packed.cpu().unbind(0), strict=True))
    return out


def reduce_stats_once(
    stats: Mapping[str, torch.Tensor | float | int],
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Reduce named scalars over ``group`` by name (`stat_kind`: sums, ``*_max``, ``*_min``) in ONE collective.

    Every rank must pass the same keys. With sums only it is one all-reduce; with extremes too, one all-gather of
    the packed values, reduced on every rank in rank order (the same floats on every rank). Returns plain floats;
    identity without a group."""
    names = sorted(stats)
    local = [float(stats[n]) for n in names]
    if group is None or not dist.is_initialized() or not names:
        return dict(zip(names, local, strict=True))
    kinds = [stat_kind(n) for n in names]
    if all(k == "sum" for k in kinds):
        return dict(zip(names, _reduce(local, dist.ReduceOp.SUM, group, device), strict=True))
    packed = _pack(local, device, group)
    parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, packed, group=group)
    table = torch.stack(parts).cpu()  # [ranks, names], float64
    out = {}
    for column, (name, kind) in enumerate(zip(names, kinds, strict=True)):
        values = table[:, column]
        reduced = values.max() if kind == "max" else values.min() if kind == "min" else values.sum()
        out[name] = float(reduced)
    return out
