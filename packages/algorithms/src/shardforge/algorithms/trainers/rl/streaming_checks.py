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
    """Asynchronous rollouts (whole batches or streamed) with several ranks: every rank's generator threads drive
    the rollout engine on their own, so the engine is either the rank's own (its weights switch when its groups need)
    or shared by the ranks with calls that name their weight version: the Ray rollout actors (an embedded-HF actor
    runs one call at a time, loading that version first: `shardforge.rollout.ray.hf_actor`), or a vLLM server, a Ray
    actor or one the trainer starts or reaches by ``server_url``, which switches only while no rank's call is in
    flight (`shardforge.rollout.server.version_gate`). What that cannot do yet is refused here, one line each."""
    if not config.async_rollouts or world_size <= 1:
        return
    rollout = config.rollout
    if rollout.placement == "disaggregated" or rollout.engine == "hf":
        return  # the Ray rollout actors (their refusals: `rollout_actor_spec`), or an engine per rank
    mode = "streaming_rollouts=true" if config.streaming_rollouts else "async_rollouts=true"
    if rollout.engine != "vllm":  # a user's engine: whether it is per rank is the user's to know
        if config.streaming_rollouts:
            raise ValueError(
                f"{mode} with {world_size} ranks needs a rollout engine per rank or one whose calls name their "
                f"weight version (rollout.engine={rollout.engine!r} is neither known to be): use rollout.engine=hf, "
                "rollout.engine=vllm, or the Ray rollout actors (rollout.placement=disaggregated, --launcher ray)"
            )
        return
    vllm = rollout.vllm
    if vllm.mode == "in_process":
        if vllm.placement != "each_rank":
            raise ValueError(
                f"{mode} with {world_size} ranks and rollout.vllm.placement=rank0 is not supported (rank 0's vLLM "
                "gathers every rank's prompts with collectives, which a generator thread cannot run): use "
                "rollout.vllm.placement=each_rank, rollout.vllm.mode=server, or rollout.engine=hf"
            )
        return
    # weight_transport=collective with asynchronous rollouts is refused at any world size (`check_rollout_batch`)
    shared = f"{mode} with {world_size} ranks on one vLLM server (rollout.vllm.mode=server)"
    refusals = [
        (
            vllm.on_server_failure == "restart",
            "does not restart the server yet (the ranks agree on restarts per synchronous round): set "
            "rollout.vllm.on_server_failure=error",
        ),
        (vllm.enable_sleep_mode, "keeps the server awake: set rollout.vllm.enable_sleep_mode=false"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{shared} {why}")


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
