"""Per-rank parameter bytes of a layout, computed from shapes (no process group needed).

Mirrors what the engine does (`TrainEngine._build_model`): TP shards the dim the built-in
plan names; experts split dim 0 over ep and their intermediate over expert TP; FSDP2 then
shards dim 0 of every (TP-local) tensor over its mesh, padding dim 0 up to a multiple of the
shard count (``ceil(dim0 / n)`` rows per rank). ``test_plan_shards.py`` checks these counts
against the real `apply_tensor_parallel` + `apply_fsdp` on a fake process group.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardforge.algorithms.plan.stats import LayerSpec, ModelStats, ParamInfo
from shardforge.mesh import ParallelDims

__all__ = ["ShardPlan", "shard_plan"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """How parameters are split on one rank of a layout."""

    dims: ParallelDims
    fsdp_size: int
    """Ranks a dense parameter is sharded over by FSDP (1 = no FSDP)."""
    expert_fsdp_size: int
    """Ranks an expert tensor is sharded over by FSDP (its own unit over efsdp when ep > 1)."""
    expert_tp: int
    """Ranks that split each expert's intermediate dim."""

    @property
    def fsdp(self) -> bool:
        """Whether the engine applies FSDP at all (some data-parallel axis > 1)."""
        d = self.dims
        return d.dp_shard * d.cp > 1 or d.dp_replicate > 1

    def tp_local_shape(self, p: ParamInfo) -> tuple[int, ...]:
        """Shape after TP / EP / expert TP (what FSDP all-gathers back to)."""
        shape = list(p.shape)
        if p.expert:
            shape[0] //= self.dims.ep
            if p.expert_tp_dim is not None and self.expert_tp > 1:
                shape[p.expert_tp_dim] //= self.expert_tp
        elif p.tp_dim is not None and self.dims.tp > 1:
            shape[p.tp_dim] //= self.dims.tp
        return tuple(shape)

    def gathered_numel(self, p: ParamInfo) -> int:
        n = 1
        for s in self.tp_local_shape(p):
            n *= s
        return n

    def local_numel(self, p: ParamInfo) -> int:
        """Elements this rank stores (FSDP dim-0 shard incl. padding)."""
        shape = self.tp_local_shape(p)
        n = self.expert_fsdp_size if p.expert else self.fsdp_size
        rows = _ceil_div(shape[0], n) if n > 1 else shape[0]
        rest = 1
        for s in shape[1:]:
            rest *= s
        return rows * rest

    def layer_local(self, spec: LayerSpec, *, experts: bool | None = None) -> int:
        return sum(self.local_numel(p) for p in spec.params if experts is None or p.expert == experts)

    def layer_gathered(self, spec: LayerSpec, *, experts: bool | None = None) -> int:
        return sum(self.gathered_numel(p) for p in spec.params if experts is None or p.expert == experts)


def shard_plan(stats: ModelStats, dims: ParallelDims) -> ShardPlan:
    """The `ShardPlan` of ``dims`` (resolved) for ``stats``' model, as the engine would build it."""
    dense = 1
    if dims.world_size > 1:
        if dims.fsdp > 1:
            dense = dims.fsdp  # HSDP shards within fsdp and replicates over dp_replicate
        elif dims.dp_replicate > 1:
            dense = dims.dp_replicate  # replicate-only layouts shard over the replicas (ParallelContext.fsdp_mesh)
    expert_tp = 1
    if stats.num_experts and dims.tp > 1:
        if dims.ep == 1 and dims.pp == 1:
            expert_tp = dims.tp  # expert TP over tp (engine.features.moe.apply_moe)
        elif dims.ep > 1 and dims.etp == dims.tp:
            expert_tp = dims.tp
    expert_fsdp = dims.efsdp if dims.ep > 1 else dense
    return ShardPlan(dims=dims, fsdp_size=dense, expert_fsdp_size=expert_fsdp, expert_tp=expert_tp)
