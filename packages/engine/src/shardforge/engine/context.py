"""`ParallelContext`: what every part of the engine needs to know about the layout.

Built once per engine, after the layout is checked (`engine.checks`) and the process group
exists. Builders, runners, heads and the I/O methods take this object instead of the whole
engine, so no module reads another's private state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardforge.engine.config import EngineConfig, parse_dtype
from shardforge.fsdp_wrap import ActivationCheckpointConfig, FSDPConfig
from shardforge.mesh import ParallelDims, ParallelMesh

__all__ = ["ParallelContext"]


@dataclass(frozen=True, kw_only=True)
class ParallelContext:
    """The layout, mesh, device and sharding settings of one engine."""

    dims: ParallelDims
    """The resolved parallel layout."""
    mesh: ParallelMesh | None
    """Named-axis device mesh; None on a single process without a process group."""
    device: torch.device
    """The compute device (CUDA under NCCL, else CPU); collectives get tensors here."""
    config: EngineConfig
    """The engine's settings."""

    @property
    def param_dtype(self) -> torch.dtype:
        return parse_dtype(self.config.param_dtype)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.config.compute_dtype) if self.config.compute_dtype else None

    @property
    def distributed(self) -> bool:
        """Whether the model is sharded over a process group (else: one plain module)."""
        return self.mesh is not None and self.dims.world_size > 1

    @property
    def is_main(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    # ---------------------------------------------------------------- groups
    def _group(self, axis: str) -> dist.ProcessGroup | None:
        if self.mesh is None or not self.mesh.has(axis):
            return None
        return self.mesh.get(axis).get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Ranks holding different data (losses and weights are summed over them)."""
        return self._group("dp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self._group("cp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.local_rank("dp") if self.mesh is not None else 0

    @property
    def cp_rank(self) -> int:
        return self.mesh.local_rank("cp") if self.mesh is not None else 0

    def local_rank(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` (0 without a mesh)."""
        return self.mesh.local_rank(axis) if self.mesh is not None else 0

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank (None without a process group)."""
        return dist.group.WORLD if dist.is_initialized() else None

    # ---------------------------------------------------------------- sharding settings
    @property
    def token_multiple(self) -> int:
        """Packed lengths must be a multiple of this: cp splits the sequence, and so does
        tensor-parallel sequence parallelism within each CP chunk."""
        sp = self.dims.tp if self.dims.tp > 1 and self.config.sequence_parallel else 1
        return self.dims.cp * sp

    def ac_config(self) -> ActivationCheckpointConfig:
        return ActivationCheckpointConfig(mode=self.config.activation_checkpointing, every=self.config.checkpoint_every)

    def fsdp_config(self) -> FSDPConfig:
        return FSDPConfig(
            param_dtype=self.compute_dtype,
            reduce_dtype=torch.float32,
            reshard_after_forward=self.config.reshard_after_forward,
            cpu_offload=self.config.cpu_offload,
            layers_per_unit=self.config.fsdp_layers_per_unit,
            forward_prefetch=self.config.fsdp_forward_prefetch,
        )

    def fsdp_mesh(self) -> Any | None:
        """The mesh parameters are sharded over (HSDP: 2-D), or None when nothing is sharded."""
        if self.mesh is None:
            return None
        if self.mesh.has("dp_replicate") and self.mesh.has("fsdp"):
            return self.mesh.get(("dp_replicate", "fsdp"))
        if self.mesh.has("fsdp"):
            return self.mesh.get("fsdp")
        if self.mesh.has("dp_replicate"):
            # Replicate-only layouts (r>1, d=1) shard over the replicas: numerically the same
            # as DDP, with less memory.
            return self.mesh.get("dp_replicate")
        return None  # no data-parallel axis (e.g. pure TP): nothing to shard
