"""Enumerate the layouts the engine accepts for a model and world size, predict and rank them.

Validity is the engine's own: `engine.checks.check_engine` (tp divides heads / kv heads /
vocab / MLP width, cp fits the heads per TP rank, pp <= layers, EP/ETP rules) and, for
pp > 1, `engine.checks.check_pipeline` (layer split, no tied embeddings, no pp with
cp or ep). A layout the engine would refuse is never proposed.

Ranking of the layouts that fit (lower is better, in order):
1. model-parallel degree tp x cp x pp (i.e. the most data parallelism: every extra TP/CP/PP
   rank adds per-layer or per-micro-batch communication that data parallelism does not);
2. tp, then pp, then cp (TP's per-layer all-gathers / reduce-scatters are the heaviest traffic,
   then the pipeline bubble, then CP's all-to-alls);
3. DDP before FSDP (a replicate-only layout run as DDP, `plan.ddp`: one bucketed all-reduce per
   step instead of per-layer all-gathers and reduce-scatters), proposed when it fits;
4. more dp_replicate (smaller FSDP groups: all-gathers span fewer ranks); a replicate-only layout
   run as FSDP counts as one FSDP group, since the engine shards it over the replicas;
5. lower predicted peak memory (headroom).
Layouts that do not fit follow, by predicted peak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shardforge.algorithms.plan.ddp import ddp_applies, estimate_ddp_memory
from shardforge.algorithms.plan.memory import MemoryEstimate, estimate_memory
from shardforge.algorithms.plan.options import PlanOptions
from shardforge.algorithms.plan.stats import ModelStats
from shardforge.mesh import ParallelDims, divisors

__all__ = ["PlanResult", "enumerate_layouts", "plan_layouts", "rank_key", "validate_for_engine"]


def validate_for_engine(dims: ParallelDims, stats: ModelStats, opts: PlanOptions) -> None:
    """Raise `ValueError` exactly when `TrainEngine` would refuse ``dims`` for this model."""
    from shardforge.engine.checks import check_engine
    from shardforge.engine.config import EngineConfig

    check_engine(dims, stats.hf_config, EngineConfig(pp_schedule=opts.pp_schedule))


def _check_world(world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def enumerate_layouts(stats: ModelStats, world_size: int, opts: PlanOptions) -> list[ParallelDims]:
    """Every (pp, dp_replicate, dp_shard, cp, tp, ep) with product world_size the engine accepts."""
    _check_world(world_size)
    out: list[ParallelDims] = []
    for pp in divisors(world_size):
        if pp > stats.num_layers:
            continue
        for tp in divisors(world_size // pp):
            for cp in divisors(world_size // (pp * tp)):
                for rep in divisors(world_size // (pp * tp * cp)):
                    shard = world_size // (pp * tp * cp * rep)
                    eps = [1]
                    if stats.num_experts:
                        eps = [e for e in divisors(shard * cp * tp) if stats.num_experts % e == 0]
                    for ep in eps:
                        dims = ParallelDims(pp=pp, tp=tp, cp=cp, dp_replicate=rep, dp_shard=shard, ep=ep)
                        try:
                            dims.validate(world_size)
                            validate_for_engine(dims, stats, opts)
                        except ValueError:
                            continue
                        out.append(dims)
    return out


def rank_key(est: MemoryEstimate) -> tuple[int, int, int, int, int, int, int]:
    d = est.dims
    # Replicate-only layouts (dp_shard x cp = 1) run as FSDP are sharded over the replicas by the engine:
    # plain FSDP, no HSDP benefit, so they rank as one FSDP group.
    replicas = d.dp_replicate if d.dp_shard * d.cp > 1 else 1
    return (d.tp * d.cp * d.pp, d.tp, d.pp, d.cp, est.data_parallel != "ddp", -replicas, est.total)


@dataclass(frozen=True, slots=True)
class PlanResult:
    """Ranked predictions: ``fitting`` (best first) then ``too_big`` (smallest first)."""

    fitting: list[MemoryEstimate]
    too_big: list[MemoryEstimate]
    budget: int | None
    world_size: int
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    """Layouts asked for by name that the engine would refuse: (layout, why)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "rejected": [{"layout": layout, "error": why} for layout, why in self.rejected],
            "world_size": self.world_size,
            "budget_bytes": self.budget,
            "seconds": self.seconds,
            "timings": dict(self.timings),
            "fitting": [e.as_dict() for e in self.fitting],
            "too_big": [e.as_dict() for e in self.too_big],
        }


def plan_layouts(
    stats: ModelStats,
    world_size: int,
    opts: PlanOptions,
    budget: int | None = None,
    *,
    layouts: list[str] | None = None,
) -> PlanResult:
    """Predict every valid layout (or just ``layouts``) and rank those within ``budget`` bytes."""
    started = time.perf_counter()
    rejected: list[tuple[str, str]] = []
    if layouts:  # one refused layout is reported with its reason; the others are still planned
        candidates = []
        for text in layouts:
            try:
                dims = ParallelDims.parse(text).resolve(world_size)
                validate_for_engine(dims, stats, opts)
            except ValueError as exc:
                rejected.append((text, str(exc)))
                continue
            candidates.append(dims)
        if not candidates:
            raise ValueError("; ".join(f"layout {text}: {why}" for text, why in rejected))
    else:
        candidates = enumerate_layouts(stats, world_size, opts)
    enumerated = time.perf_counter()
    estimates = [estimate_memory(stats, dims, opts) for dims in candidates]
    estimates += [estimate_ddp_memory(stats, dims, opts) for dims in candidates if ddp_applies(dims, opts)]
    fits = [e for e in estimates if budget is None or e.total <= budget]
    fitting = sorted(fits, key=rank_key)
    too_big = sorted((e for e in estimates if budget is not None and e.total > budget), key=lambda e: e.total)
    done = time.perf_counter()
    return PlanResult(
        fitting=fitting,
        too_big=too_big,
        budget=budget,
        world_size=world_size,
        seconds=done - started,
        timings={"enumerate_s": enumerated - started, "estimate_s": done - enumerated, "layouts": len(estimates)},
        rejected=rejected,
    )
