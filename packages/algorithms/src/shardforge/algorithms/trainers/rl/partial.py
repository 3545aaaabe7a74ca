"""Partial (interruptible) rollouts for asynchronous GRPO and PPO: the settings' checks and the staleness metrics.

With ``rollout.partial_rollouts=true`` the rollout engine (embedded HF, or vLLM in-process / server through
`rollout.chunked`) generates ``rollout.interrupt_chunk_tokens`` tokens at a time;
between chunks the background generator loads the newest weights the batch may use, and unfinished
responses continue under them (`AsyncRollouts`, `HFRolloutEngine`). Every token keeps its weight version
and behaviour log-prob, which the decoupled loss and rollout correction use token by token. With
``streaming_rollouts=true`` a weight update interrupts the streamed groups still generating in the same way
(`streaming_source.StreamingSource`); there ``max_staleness=0`` is allowed (nothing is ever interrupted: the
synchronous baseline of a staleness sweep).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["check_partial_rollouts"]


def check_partial_rollouts(config: Any) -> None:
    """Refuse settings that partial rollouts cannot honour (``config``: a `GRPOConfig` or `PPOConfig`)."""
    if not config.rollout.partial_rollouts:
        return
    if not config.async_rollouts:
        raise ValueError(
            "rollout.partial_rollouts=true interrupts generations when the trainer publishes new weights, which only happens "
            "while generating in the background: set async_rollouts=true (with max_staleness >= 1) or "
            "rollout.partial_rollouts=false"
        )
    if config.max_staleness < 1 and not config.streaming_rollouts:  # streaming at 0: the synchronous baseline
        raise ValueError(
            "rollout.partial_rollouts=true with max_staleness=0 never overlaps generation with training, so no newer weights "
            "arrive mid-generation: set max_staleness >= 1 or rollout.partial_rollouts=false"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if config.rollout.engine == "vllm" and world > 1:
        if config.rollout.vllm.mode == "server":
            raise ValueError(
                f"rollout.partial_rollouts=true on a vLLM server needs a trainer world size of 1 (got {world}): one rank's "
                "weight switch between its chunks would change the weights under the other ranks' requests; use "
                "rollout.vllm.mode=in_process with rollout.vllm.placement=each_rank, or rollout.engine=hf"
            )
        if config.rollout.vllm.placement == "rank0":
            raise ValueError(
                f"rollout.partial_rollouts=true with rollout.vllm.placement=rank0 and {world} ranks is not supported (every rank "
                "would need the same number of chunks): use rollout.vllm.placement=each_rank, or rollout.engine=hf"
            )
    if config.engine.router_replay:
        raise ValueError(
            "rollout.partial_rollouts=true with engine.router_replay=true is not supported: a continued generation "
            "recomputes its context under new weights, so the recorded routing would mix versions; "
            "turn one of them off"
        )
