"""``layout: auto``: the planner's best data-parallel layout for the model, the world size and the memory.

The CLI resolves it (`resolve_auto_layout`) in the launching process and again in every rank, from the
same inputs, so all agree; it sets ``layout`` and ``engine.data_parallel`` and prints one line. Only
data-parallel layouts are candidates (FSDP, HSDP ``rNdM``, DDP ``rN`` with ``engine.data_parallel=ddp``):
model-parallel axes (tp, cp, pp, ep) change what a model and a trainer must support, so they stay explicit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from shardforge.algorithms.plan.layouts import plan_layouts
from shardforge.algorithms.plan.options import PlanOptions
from shardforge.algorithms.plan.presets import load_model_config
from shardforge.algorithms.plan.report import layout_string
from shardforge.algorithms.plan.stats import model_stats

__all__ = ["AUTO", "memory_per_rank", "resolve_auto_layout"]

AUTO = "auto"


def memory_per_rank(world_size: int) -> int:
    """Bytes one rank may use: the GPU's memory (CUDA), else this host's RAM shared by its ranks."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // max(local, 1)


def resolve_auto_layout(config: Any, world_size: int) -> tuple[Any, str | None]:
    """``config`` (a frozen dataclass) with ``layout: auto`` replaced by the planner's first-ranked
    data-parallel layout and ``engine.data_parallel`` set, and the one-line report; an explicit layout
    comes back unchanged, with None."""
    if getattr(config, "layout", None) != AUTO:
        return config, None
    engine = config.engine
    lora = getattr(engine, "lora", None)
    opts = PlanOptions(
        seq_len=engine.max_tokens_per_microbatch,
        micro_batch_tokens=engine.max_tokens_per_microbatch,
        param_dtype=engine.param_dtype,
        lora_rank=int(lora.r) if lora is not None else 0,
    )
    budget = int(memory_per_rank(world_size) * 0.9)
    stats = model_stats(load_model_config(config.model))
    result = plan_layouts(stats, world_size, opts, budget)
    ranked = [e for e in result.fitting + result.too_big if max(e.dims.tp, e.dims.cp, e.dims.pp, e.dims.ep) == 1]
    if not ranked:
        raise ValueError(f"layout=auto: no data-parallel layout for {world_size} ranks; set layout= explicitly")
    best = ranked[0]
    layout = layout_string(best.dims)
    config = dataclasses.replace(
        config, layout=layout, engine=dataclasses.replace(engine, data_parallel=best.data_parallel)
    )
    fits = "fits" if best.total <= budget else "does not fit"
    return config, (
        f"layout=auto -> layout={layout} engine.data_parallel={best.data_parallel} "
        f"(planner's best of {len(ranked)} data-parallel layouts for {world_size} ranks; predicted peak "
        f"{best.total / 2**20:.0f} MiB per rank, {fits} {budget / 2**30:.1f} GiB)"
    )
