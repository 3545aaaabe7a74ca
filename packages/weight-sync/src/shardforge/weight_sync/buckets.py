"""Gather a sharded model's parameters into full tensors, one bucket at a time.

Every trainer rank walks the parameters in the same order and joins each
``full_tensor()`` all-gather; only the sending rank keeps the results. A bucket holds
whole tensors up to ``bucket_bytes`` (a single larger tensor gets a bucket of its own),
so the sender never holds the whole model: at most the bucket being gathered plus the one
being transferred.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Bucket", "canonical_parameters", "iter_buckets"]


@dataclass
class Bucket:
    """Full tensors of consecutive parameters, in HF naming."""

    index: int
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


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


def iter_buckets(
    model: nn.Module,
    bucket_bytes: int,
    *,
    keep: bool,
    dtype: torch.dtype | None = None,
) -> Iterator[Bucket | None]:
    """Yield one item per bucket on every rank: the `Bucket` where ``keep``, else None.

    Collective: all ranks holding shards of ``model`` must iterate in lockstep.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    current = Bucket(0)
    current_bytes = 0
    for name, value in canonical_parameters(model):
        full = value.detach()
        if isinstance(full, DTensor):
            full = full.full_tensor()
        target_dtype = dtype if (dtype is not None and full.is_floating_point()) else full.dtype
        size = full.numel() * torch.empty((), dtype=target_dtype).element_size()
        if current.names and current_bytes + size > bucket_bytes:
            yield current if keep else None
            current, current_bytes = Bucket(current.index + 1), 0
        current.names.append(name)
        if keep:
            current.tensors.append(full.to(device="cpu", dtype=target_dtype, copy=True))
        current_bytes += size
        del full
    if current.names:
        yield current if keep else None
