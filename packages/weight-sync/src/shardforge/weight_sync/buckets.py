"""Gather a sharded model's parameters into full tensors, one bucket at a time.

Every trainer rank walks the parameters in the same order; only the sending rank keeps the
results. A bucket holds whole tensors up to ``bucket_bytes`` (a single larger tensor gets a
bucket of its own), laid out in **one flat byte buffer** (``Bucket.flat``; the tensors are
views into it), so a transport sends or writes it without another copy.

How a tensor reaches the sender:

- A DTensor sharded on dim 0 over one mesh axis and replicated on the others (FSDP, HSDP,
  expert FSDP): every rank of the sender's shard group casts its local shard to the target
  dtype and sends it point to point; the sender receives each shard straight into its place
  in the bucket. Ranks outside that group (other HSDP replicas) do nothing. Casting before
  the transfer moves bf16, not fp32, and no rank but the sender ever holds a full tensor.
- Any other DTensor (tensor parallel, 2-D FSDP x TP, ...): cast the local shard, then
  ``full_tensor()`` on every rank of its mesh, copied into the bucket on the sender.
- Plain tensors: copied (and cast) into the bucket on the sender.

With ``src_rank=None`` every rank keeps the buckets (engines in every trainer process): each
DTensor goes through one ``full_tensor()`` (an all-gather of the cast shards) instead of
point-to-point transfers to one rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # imported where used: `import shardforge.weight_sync` (a config reader) skips DTensor's ~1 s
    from torch.distributed.tensor import DTensor

__all__ = ["Bucket", "canonical_parameters", "iter_buckets"]

_ALIGN = 64  # byte alignment of each tensor inside a bucket's flat buffer


@dataclass
class Bucket:
    """Full tensors of consecutive parameters, in HF naming.

    On the sender, ``tensors[i]`` is a view of ``flat[offsets[i] : offsets[i] + nbytes_i]``.
    Transports must not keep references to ``flat``/``tensors`` after ``send`` returns (the
    publisher may reuse the buffer for a later bucket); copy what must outlive the call.
    """

    index: int
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    flat: torch.Tensor | None = None
    """uint8 buffer holding every tensor of the bucket (None for a bucket built by hand)."""
    offsets: list[int] = field(default_factory=list)
    """Byte offset of each tensor in ``flat``."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True)
class _Entry:
    name: str
    value: torch.Tensor
    dtype: torch.dtype
    nbytes: int


def canonical_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for parameters and persistent buffers, tied aliases listed once.

    Names are the module's fully qualified names, which for HF models are the names in
    their safetensors checkpoints. (checkpoint-dcp has the same rule; feature packages
    do not import each other, so it is repeated here.)
    """
    entries: list[tuple[str, torch.Tensor]] = list(model.named_parameters())  # drops tied aliases
    skip: set[str] = set()
    for module_name, module in model.named_modules():
        for buffer_name in getattr(module, "_non_persistent_buffers_set", set()):
            skip.add(f"{module_name}.{buffer_name}" if module_name else buffer_name)
    entries += [(n, b) for n, b in model.named_buffers() if n not in skip]
    return entries


def _plan(model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None) -> list[list[_Entry]]:
    """Split the parameters into buckets from metadata only (identical on every rank)."""
    buckets: list[list[_Entry]] = [[]]
    size = 0
    for name, value in canonical_parameters(model):
        value = value.detach()
        target = dtype if (dtype is not None and value.is_floating_point()) else value.dtype
        nbytes = value.numel() * torch.empty((), dtype=target).element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(_Entry(name, value, target, nbytes))
        size += nbytes
    return [b for b in buckets if b]


def aligned(n: int) -> int:
    """``n`` rounded up to the byte alignment of tensors inside a bucket buffer."""
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(entries: list[_Entry]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for entry in entries:
        offsets.append(end)
        end = aligned(end + entry.nbytes)
    return offsets, end


def _dim0_shard_axis(value: DTensor) -> int | None:
    """The mesh axis a DTensor is sharded over on tensor dim 0, if that is its only sharding."""
    from torch.distributed.tensor import Replicate, Shard

    axes = [i for i, p in enumerate(value.placements) if not isinstance(p, Replicate)]
    if len(axes) == 1 and value.placements[axes[0]] == Shard(0) and value.dim() > 0:
        return axes[0]
    return None


def _chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """(first row, row count) of chunk ``index`` when ``rows`` are split like `torch.chunk`
    (the rule DTensor's ``Shard`` uses)."""
    full = -(-rows // parts) if rows else 0
    start = min(index * full, rows)
    return start, max(0, min(rows, start + full) - start)


class _Gather:
    """Point-to-point shard transfers of one bucket, posted together and then awaited."""

    def __init__(self, src_rank: int) -> None:
        self.src_rank = src_rank
        self.rank = dist.get_rank()
        self.works: list[dist.Work | None] = []
        self.keep_alive: list[torch.Tensor] = []
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device staging, CPU target)

    def add(self, value: DTensor, axis: int, dtype: torch.dtype, out: torch.Tensor | None) -> bool:
        """Post the transfers of one dim-0-sharded tensor; False if the sender is not in its group."""
        group = value.device_mesh.get_group(axis)
        ranks = dist.get_process_group_ranks(group)
        if self.src_rank not in ranks:
            return False  # another replica's shards: the sender gets them from its own group
        local = value.to_local()
        if self.rank != self.src_rank:
            shard = local.detach().to(dtype).contiguous()
            if shard.numel():
                self.keep_alive.append(shard)
                self.works.append(dist.isend(shard, dst=self.src_rank))
            return True
        assert out is not None
        rows = value.shape[0]
        flat_out = out.view(rows, -1) if out.numel() else out
        for index, peer in enumerate(ranks):
            start, count = _chunk_rows(rows, len(ranks), index)
            if count == 0:
                continue
            target = flat_out[start : start + count]
            if peer == self.rank:
                target.copy_(local.detach().reshape(count, -1))
            elif local.device.type == "cpu":
                self.works.append(dist.irecv(target, src=peer))
            else:  # NCCL receives into device memory; copied into the CPU bucket after the wait
                staging = torch.empty(target.shape, dtype=dtype, device=local.device)
                self.copies.append((staging, target))
                self.works.append(dist.irecv(staging, src=peer))
        return True

    def wait(self) -> None:
        for work in self.works:
            if work is not None:
                work.wait()
        for staging, target in self.copies:
            target.copy_(staging)
        self.works.clear()
        self.keep_alive.clear()
        self.copies.clear()


def iter_buckets(
    model: nn.Module,
    bucket_bytes: int,
    *,
    src_rank: int | None = 0,
    dtype: torch.dtype | None = None,
    ring: int = 0,
) -> Iterator[Bucket | None]:
    """Yield one item per bucket on every rank: the `Bucket` on ``src_rank`` (every rank when
    ``src_rank`` is None), else None.

    Collective: all ranks holding shards of ``model`` must iterate in lockstep.

    Args:
        src_rank: the (global) rank that receives the full tensors; None = every rank.
        dtype: cast floating-point tensors (before they are transferred).
        ring: reuse this many flat buffers round-robin on the sender (bucket k lands in buffer
            ``k % ring``; 0 = a fresh buffer per bucket). Fresh buffers cost page faults as
            expensive as a copy; with a ring the caller must be done with bucket k before it
            asks for bucket k + ring.
    """
    from torch.distributed.tensor import DTensor

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    keep = src_rank is None or rank == src_rank
    plans = _plan(model, bucket_bytes, dtype)
    layouts = [_layout(entries) for entries in plans]
    # Ring buffers are sized for the largest bucket up front: growing one later would keep the
    # old and the new buffer alive at once.
    largest = max((total for _, total in layouts), default=0)
    buffers: list[torch.Tensor | None] = [None] * ring
    for index, entries in enumerate(plans):
        offsets, total = layouts[index]
        flat: torch.Tensor | None = None
        views: list[torch.Tensor] = []
        if keep:
            if ring:
                if buffers[index % ring] is None:
                    buffers[index % ring] = torch.empty(largest, dtype=torch.uint8)
                flat = buffers[index % ring][:total]  # type: ignore[index]
            else:
                flat = torch.empty(total, dtype=torch.uint8)
            for entry, offset in zip(entries, offsets):
                raw = flat[offset : offset + entry.nbytes]
                views.append(raw.view(entry.dtype).view(entry.value.shape))
        gather = _Gather(src_rank) if distributed and src_rank is not None else None
        fallback: list[int] = []
        for i, entry in enumerate(entries):
            value = entry.value
            out = views[i] if keep else None
            if isinstance(value, DTensor):
                axis = _dim0_shard_axis(value)
                if axis is None or gather is None:
                    fallback.append(i)
                else:
                    gather.add(value, axis, entry.dtype, out)
            elif out is not None:
                out.copy_(value)
        if gather is not None:
            gather.wait()
        for i in fallback:  # after the point-to-point phase, in the same order on every rank
            value = entries[i].value
            assert isinstance(value, DTensor)
            full = value.to(entries[i].dtype).full_tensor()  # type: ignore[attr-defined]
            if keep:
                views[i].copy_(full)
            del full
        if keep:
            yield Bucket(index, [e.name for e in entries], views, flat, offsets)
        else:
            yield None
