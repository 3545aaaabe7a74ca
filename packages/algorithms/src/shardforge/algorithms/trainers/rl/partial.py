"""Partial (interruptible) rollouts for asynchronous GRPO: the settings' checks and the engine switch.

With ``partial_rollouts=true`` the rollout engine (embedded HF, or vLLM in-process / server through
`rollout.chunked`) generates ``interrupt_chunk_tokens`` tokens at a time;
between chunks the background generator loads the newest weights the batch may use, and unfinished
responses continue under them (`AsyncRollouts`, `HFRolloutEngine`). Every token keeps its weight version
and behaviour log-prob, which the decoupled loss and rollout correction use token by token.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from shardforge.algorithms.trainers.rl.partial_stats import STALENESS_COUNTS, staleness_metrics
from shardforge.mesh.collectives import all_reduce_max, all_reduce_sum

__all__ = ["check_partial_rollouts", "enable_partial_rollouts", "partial_rollout_stats"]


def check_partial_rollouts(config: Any) -> None:
    """Refuse settings that partial rollouts cannot honour (``config``: a `GRPOConfig`)."""
    chunk = config.interrupt_chunk_tokens
    if chunk < 1:
        raise ValueError(
            f"interrupt_chunk_tokens={chunk} must be >= 1 (tokens generated between two checks for new weights; "
            "e.g. 16)"
        )
    if not config.partial_rollouts:
        return
    if not config.async_rollouts:
        raise ValueError(
            "partial_rollouts=true interrupts generations when the trainer publishes new weights, which only happens "
            "while generating in the background: set async_rollouts=true (with max_staleness >= 1) or "
            "partial_rollouts=false"
        )
    if config.max_staleness < 1:
        raise ValueError(
            "partial_rollouts=true with max_staleness=0 never overlaps generation with training, so no newer weights "
            "arrive mid-generation: set max_staleness >= 1 or partial_rollouts=false"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if config.rollout_engine == "vllm" and world > 1:
        if config.vllm.mode == "server":
            raise ValueError(
                f"partial_rollouts=true on a vLLM server needs a trainer world size of 1 (got {world}): one rank's "
                "weight switch between its chunks would change the weights under the other ranks' requests; use "
                "vllm.mode=in_process with vllm.placement=each_rank, or rollout_engine=hf"
            )
        if config.vllm.placement == "rank0":
            raise ValueError(
                f"partial_rollouts=true with vllm.placement=rank0 and {world} ranks is not supported (every rank "
                "would need the same number of chunks): use vllm.placement=each_rank, or rollout_engine=hf"
            )
    if config.engine.router_replay:
        raise ValueError(
            "partial_rollouts=true with engine.router_replay=true is not supported: a continued generation "
            "recomputes its context under new weights, so the recorded routing would mix versions; "
            "turn one of them off"
        )


def enable_partial_rollouts(config: Any, rollout: Any) -> None:
    """Make the rollout engine (HF or vLLM) generate in interruptible chunks when partial rollouts are on."""
    if config.partial_rollouts:
        rollout.interrupt_chunk_tokens = config.interrupt_chunk_tokens


def partial_rollout_stats(counts: dict[str, float], engine: Any) -> dict[str, float]:
    """The step's ``partial/*`` metrics from every data-parallel rank's staleness counts (`SampledBatch.stats`):
    sums of the counts, max of the oldest token's lag (two collectives over ``engine.dp_group``; every rank calls
    it). A batch restored from a checkpoint written before the counts existed contributes zeros."""
    sums = all_reduce_sum(*(counts.get(k, 0.0) for k in STALENESS_COUNTS), group=engine.dp_group, device=engine.device)
    (lag_max,) = all_reduce_max(counts.get("lag_max", 0.0), group=engine.dp_group, device=engine.device)
    return staleness_metrics(dict(zip(STALENESS_COUNTS, sums, strict=True)) | {"lag_max": lag_max})
