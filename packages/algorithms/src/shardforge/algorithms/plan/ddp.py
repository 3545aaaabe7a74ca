"""Replicate-only layouts as DDP (``engine.data_parallel=ddp``): a whole model per rank.

A layout that only replicates (``rN``: dp_replicate = N, every other axis 1) can run two ways:
FSDP over the replicas (the engine's default: least memory, but every layer's parameters are
all-gathered in forward and backward and its gradients reduce-scattered) or DDP (a full copy
per rank, gradients all-reduced in buckets overlapped with backward; about 2/3 of FSDP's bytes
on the wire and far fewer, larger collectives). The planner proposes the DDP form when it fits
and ranks it before the FSDP forms of the same degree (see `layouts.rank_key`).

Memory of the DDP form: the one-process estimate (no FSDP: params, gradients and optimizer
state whole, computed in the param dtype) plus DDP's reducer buckets, which hold a second copy
of every trainable gradient (torch's default ``gradient_as_bucket_view=False``), alive from the
engine's construction on (counted under ``comm``).
"""

from __future__ import annotations

from dataclasses import replace

from shardforge.algorithms.plan.memory import MemoryEstimate, estimate_memory
from shardforge.algorithms.plan.options import PlanOptions
from shardforge.algorithms.plan.stats import ModelStats
from shardforge.mesh import ParallelDims

__all__ = ["ddp_applies", "estimate_ddp_memory"]


def ddp_applies(dims: ParallelDims, opts: PlanOptions) -> bool:
    """Whether ``dims`` (resolved) can run as DDP: replicate-only, and no CPU offload (DDP keeps the model on the device)."""
    d = dims
    return d.dp_replicate > 1 and d.dp_shard == d.cp == d.tp == d.pp == d.ep == 1 and not opts.cpu_offload


def estimate_ddp_memory(stats: ModelStats, dims: ParallelDims, opts: PlanOptions) -> MemoryEstimate:
    """Per-rank peak of ``dims`` run as DDP (see the module)."""
    if not ddp_applies(dims, opts):
        raise ValueError(
            f"{dims.to_string()} is not a replicate-only layout (or cpu_offload is on): DDP does not apply"
        )
    single = estimate_memory(stats, ParallelDims.parse("d1").resolve(1), opts)
    buckets = single.state["grads"]
    return replace(single, dims=dims, comm=single.comm + buckets, total=single.total + buckets, data_parallel="ddp")
