"""Checkpoints of expert-TP parameters: DTensors whose shard is several row ranges of the global tensor.

Under expert TP each rank holds, of ``gate_up_proj [E, 2I, H]`` (gate rows first), its slice of
the gate rows *and* its slice of the up rows: two separate ranges of dim 1 (placement
``_StridedShard(1, split_factor=2)``). torch 2.13 describes a DTensor shard for checkpoints by
one offset and one shape (``compute_local_shape_and_global_offset`` keeps only the first offset
of a strided dim), so DCP save fails with "overlapping chunks" and the full-state-dict broadcast
load (``set_model_state_dict(broadcast_from_rank0=True)``) copies the wrong rows.

The fix keeps the checkpoint exactly as without expert TP (same key, global shape and values):

- `checkpoint_view(p)`: a DTensor sharing ``p``'s storage whose local tensor lists its true
  chunks (one per contiguous run of global indices in each dim) through DCP's chunk protocol
  (``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``, which
  DTensor delegates to its local tensor). DCP then writes every run at its real offset and
  reads any saved layout into it by overlap, in place (no communication, no copy).
- `register_checkpoint_hooks(module)` puts views in ``module.state_dict()``;
  `register_optimizer_checkpoint_hooks(optimizer)` does the same for optimizer states of
  such parameters (``exp_avg`` ...).
- `load_full_tensor_(p, full)`: copy the right rows of a full tensor into the local shard
  (the broadcast load path, see `broadcast_full_tensors_`).

Legend: a *run* is a maximal range of consecutive global indices held locally in one dim.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "broadcast_full_tensors_",
    "checkpoint_view",
    "has_strided_shard",
    "load_full_tensor_",
    "local_global_indices",
    "register_checkpoint_hooks",
    "register_optimizer_checkpoint_hooks",
]


def has_strided_shard(t: object) -> bool:
    """Whether ``t`` is a DTensor with a `_StridedShard` placement (a shard of several row ranges)."""
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def local_global_indices(t: DTensor) -> list[torch.Tensor]:
    """For each tensor dim, the global indices of the local rows, in local order.

    Follows torch's own composition of placements (left to right over mesh dims, as in
    ``compute_local_shape_and_global_offset``) but keeps every index, not only the first.
    """
    indices = [torch.arange(n) for n in t.shape]
    coordinate = t.device_mesh.get_coordinate()
    assert coordinate is not None, "this rank is not part of the DTensor's mesh"
    for mesh_dim, placement in enumerate(t.placements):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        dim = placement.dim
        size, offsets = _get_shard_size_and_offsets(
            len(indices[dim]), t.device_mesh.size(mesh_dim), coordinate[mesh_dim], placement, None, t.shape[dim], False
        )
        assert offsets is not None
        indices[dim] = indices[dim][offsets] if size > 0 else indices[dim][:0]
    return indices


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of each run of consecutive global indices."""
    values = index.tolist()
    runs: list[tuple[int, int, int]] = []
    for local, value in enumerate(values):
        if runs and runs[-1][1] + runs[-1][2] == value:
            start_local, start_global, length = runs[-1]
            runs[-1] = (start_local, start_global, length + 1)
        else:
            runs.append((local, value, 1))
    return runs


def _chunks(t: DTensor) -> list[tuple[tuple[slice, ...], torch.Size, torch.Size]]:
    """(local slices, global offsets, sizes) of every chunk of the local shard."""
    per_dim = [_runs(index) for index in local_global_indices(t)]
    chunks = []
    for combo in itertools.product(*per_dim):
        local = tuple(slice(lo, lo + n) for lo, _, n in combo)
        chunks.append((local, torch.Size(g for _, g, _ in combo), torch.Size(n for _, _, n in combo)))
    return chunks


def checkpoint_view(t: DTensor) -> DTensor:
    """A DTensor sharing ``t``'s storage that DCP saves and loads chunk by chunk at the true offsets.

    Returns ``t`` itself when its shard is one contiguous block (nothing to fix).
    """
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    if not has_strided_shard(t):
        return t
    local = t._local_tensor.detach()
    chunks = [c for c in _chunks(t) if all(n > 0 for n in c[2])]
    if len(chunks) <= 1:
        return t
    view = local.view_as(local)

    def create_write_items(fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes), properties=properties, size=t.size()
                ),
            )
            for _, offsets, sizes in chunks
        ]

    def create_chunk_list() -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for _, offsets, sizes in chunks]

    def get_tensor_shard(index: MetadataIndex) -> torch.Tensor:
        for slices, offsets, _ in chunks:
            if index.offset == offsets:
                return view[slices]
        raise ValueError(f"no local chunk of {index.fqn} starts at {index.offset}; local chunks: {chunks}")

    # DTensor asks its local tensor for these (the protocol ShardedTensor-like wrappers use).
    view.__create_write_items__ = create_write_items  # type: ignore[attr-defined]
    view.__create_chunk_list__ = create_chunk_list  # type: ignore[attr-defined]
    view.__get_tensor_shard__ = get_tensor_shard  # type: ignore[attr-defined]
    return DTensor(view, t._spec, requires_grad=False)  # type: ignore[call-arg]


def load_full_tensor_(t: DTensor, full: torch.Tensor) -> None:
    """Copy this rank's rows of ``full`` (the global tensor) into ``t``'s local shard, in place."""
    rows = full
    for dim, index in enumerate(local_global_indices(t)):
        rows = rows.index_select(dim, index.to(rows.device))
    with torch.no_grad():
        t._local_tensor.copy_(rows)


def broadcast_full_tensors_(model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None, *, src: int = 0) -> int:
    """Re-load every strided-shard parameter of ``model`` from ``src``'s full state dict.

    Collective over the default group: ``src`` broadcasts each such tensor (one at a time),
    every rank keeps its rows. Returns the number of tensors loaded. Use after a generic
    full-state-dict load, which places these shards as if they were contiguous.
    """
    loaded = 0
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor) or not has_strided_shard(param):
            continue
        local = param._local_tensor
        if dist.get_rank() == src:
            if full_state_dict is None or name not in full_state_dict:
                raise KeyError(f"{name} is missing from the full state dict on rank {src}")
            full = full_state_dict[name].to(device=local.device, dtype=local.dtype).contiguous()
        else:
            full = torch.empty(param.shape, device=local.device, dtype=local.dtype)
        dist.broadcast(full, src=src)
        load_full_tensor_(param, full)
        loaded += 1
    return loaded


def _state_dict_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and has_strided_shard(value):
            state_dict[key] = checkpoint_view(value)


def register_checkpoint_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` return `checkpoint_view` s of its strided-shard entries."""
    module.register_state_dict_post_hook(_state_dict_hook)


def _optimizer_state_dict_hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in state_dict["state"].items():
        if isinstance(index, int) and index < len(params) and has_strided_shard(params[index]):
            # A new dict: the one in ``state_dict`` is the optimizer's own per-parameter state.
            state_dict["state"][index] = {
                key: checkpoint_view(value) if has_strided_shard(value) else value for key, value in state.items()
            }
    return state_dict


def register_optimizer_checkpoint_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` return `checkpoint_view` s of strided-shard states."""
    optimizer.register_state_dict_post_hook(_optimizer_state_dict_hook)
