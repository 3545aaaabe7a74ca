"""The settings streaming rollouts (``streaming_rollouts: true``, `streaming_source.StreamingSource`) cannot honour
yet, refused with one line each that says what is valid. Imported by the config (no torch, no engine)."""

from __future__ import annotations

from typing import Any

__all__ = ["check_async_recompute", "check_streaming_config", "check_streaming_layout"]

VALID_MODES = (
    "valid: async_rollouts=false (synchronous); async_rollouts=true (whole batches, one step ahead); "
    "async_rollouts=true with streaming_rollouts=true (streamed groups)"
)


def check_streaming_config(config: Any) -> None:
    """Refuse combinations of a `GRPOConfig` or `PPOConfig` that streaming does not support (when the config is
    built)."""
    workers = config.rollout.streaming_workers
    if workers > 1 and not config.streaming_rollouts:
        raise ValueError(
            f"rollout.streaming_workers={workers} sets the generator threads of streaming rollouts: set "
            "streaming_rollouts=true (with async_rollouts=true), or rollout.streaming_workers=1"
        )
    if not config.streaming_rollouts:
        return
    if workers > 1 and not _serves_concurrent_requests(config.rollout):
        raise ValueError(
            f"rollout.streaming_workers={workers} needs a rollout engine that serves concurrent requests "
            "(rollout.engine=vllm with rollout.vllm.mode=server, or rollout.placement=disaggregated); the embedded "
            f"engine (rollout.engine={config.rollout.engine}, placement {config.rollout.placement}) generates one call "
            "at a time: set rollout.streaming_workers=1"
        )
    if workers > 1 and config.rollout.engine == "vllm" and config.rollout.vllm.on_server_failure == "restart":
        raise ValueError(
            f"rollout.vllm.on_server_failure=restart with rollout.streaming_workers={workers} is not supported yet (each "
            "worker that finds the server down would restart it): set rollout.streaming_workers=1, or "
            "rollout.vllm.on_server_failure=error"
        )
    if not config.async_rollouts:
        raise ValueError(
            f"streaming_rollouts=true is a mode of asynchronous rollouts: set async_rollouts=true ({VALID_MODES})"
        )


def check_streaming_layout(config: Any, world_size: int) -> None:
    """With several ranks every rank streams on an engine of its own (its weights switch when its groups need), or
    on the Ray rollout actors, which they share: every call names the disk version it needs; an embedded-HF actor
    runs one call at a time, loading that version first (`shardforge.rollout.ray.hf_actor`), and the vLLM server
    actor switches only while no rank's call is in flight (`shardforge.rollout.server.version_gate`)."""
    if not config.streaming_rollouts or world_size <= 1:
        return
    rollout = config.rollout
    own = rollout.placement == "colocated" and (
        rollout.engine == "hf"
        or (rollout.engine == "vllm" and rollout.vllm.mode == "in_process" and rollout.vllm.placement == "each_rank")
    )
    per_call_versions = rollout.placement == "disaggregated"  # the HF actors, or the vLLM server actor's gate
    if not (own or per_call_versions):
        raise ValueError(
            f"streaming_rollouts=true with {world_size} ranks needs a rollout engine per rank (each rank's generator "
            "switches weights on its own) or one whose calls name their weight version: use rollout.engine=hf with "
            "rollout.placement=colocated, rollout.engine=vllm with rollout.vllm.mode=in_process and "
            "rollout.vllm.placement=each_rank, or the Ray rollout actors (rollout.placement=disaggregated, --launcher "
            "ray: rollout.engine=hf, or rollout.engine=vllm with rollout.vllm.mode=server)"
        )


def check_async_recompute(config: Any) -> None:
    """Asynchronous (and streaming) batches need the trainer's recomputed log-probs as the proximal policy."""
    from shardforge.engine.objectives.rollout_correction import ROLLOUT_CORRECTIONS

    if config.async_rollouts and not (
        config.recompute_logprobs and ROLLOUT_CORRECTIONS.get(config.rollout_correction.mode).recompute
    ):
        raise ValueError(
            "async_rollouts needs recompute_logprobs=true and a rollout_correction.mode other than bypass: "
            "stale batches need the trainer's log-probs as the proximal policy (the rollout's are the behaviour policy)"
        )


def _serves_concurrent_requests(rollout: Any) -> bool:
    """Whether generate calls from several threads run concurrently on the rollout engine (a server, or actors)."""
    server = rollout.engine == "vllm" and rollout.vllm.mode == "server"
    return bool(server or rollout.placement == "disaggregated")
