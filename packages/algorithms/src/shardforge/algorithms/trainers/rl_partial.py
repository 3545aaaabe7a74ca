"""Partial (interruptible) rollouts for asynchronous GRPO: the settings' checks and the engine switch.

With ``partial_rollouts=true`` the embedded engine generates ``interrupt_chunk_tokens`` tokens at a time;
between chunks the background generator loads the newest weights the batch may use, and unfinished
responses continue under them (`AsyncRollouts`, `HFRolloutEngine`). Every token keeps its weight version
and behaviour log-prob, which the decoupled loss and rollout correction use token by token.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_partial_rollouts", "enable_partial_rollouts"]


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
    if config.rollout_engine != "hf":
        raise ValueError(
            f"partial_rollouts=true is built for the embedded engine (rollout_engine=hf); rollout_engine="
            f"{config.rollout_engine!r} cannot be interrupted yet: use rollout_engine=hf or partial_rollouts=false"
        )
    if config.engine.router_replay:
        raise ValueError(
            "partial_rollouts=true with engine.router_replay=true is not supported: a continued generation "
            "recomputes its context under new weights, so the recorded routing would mix versions; "
            "turn one of them off"
        )


def enable_partial_rollouts(config: Any, rollout: Any) -> None:
    """Make the (embedded HF) rollout engine generate in interruptible chunks when partial rollouts are on."""
    if config.partial_rollouts:
        rollout.interrupt_chunk_tokens = config.interrupt_chunk_tokens
