"""Colocated placement: the trainer and its rollout engine take turns on the same devices.

With ``rollout.placement=colocated`` (the default) every trainer rank holds the policy twice: in the training
engine (weights, optimizer state, gradients and activations during the update) and in the rollout engine
(weights, KV caches). A synchronous RL step runs its phases in turn, and each uses one of the two::

    generate  rollout engine: weights + KV caches     trainer: idle (weights + optimizer state)
    train     rollout engine: idle (weights)          trainer: weights + optimizer state + grads + activations
    publish   the trainer's weights become the rollout engine's next version

Two options hand the memory over between phases (verl: ``rollout.free_cache_engine`` with vLLM's sleep mode,
``actor.fsdp_config.param_offload`` / ``optimizer_offload``; AReaL and ROLL do the same):

- ``rollout.sleep``: after a batch's generation the rollout engine frees its weights and KV caches
  (`HFRolloutEngine.sleep`; vLLM: level-2 sleep, `rollout.vllm_sleep`); the publish after the update
  brings a whole new version, which becomes its weights (`WeightReceiver.release`). The model directory
  (version 0) is never needed again: both trainers publish the policy before their first generation
  (and before evaluating at the start), so the engine sleeps from the start and the first publish wakes it.
- ``offload_train_state_during_rollout``: the policy's weights and optimizer state (PPO: the critic's too)
  sit in host memory during the generation and come back before the update (`TrainEngine.offloaded`).

Held-out evaluation runs right after a publish (or at the start, after the first), on an awake engine, and
the next batch's generation follows it with no training between, so the engine sleeps only after a batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from shardforge.algorithms.trainers.rl.sources import SampleFn
from shardforge.rollout.types import Sleeps

if TYPE_CHECKING:  # the launching process imports the trainers' modules for their configs
    from shardforge.engine import TrainEngine

__all__ = ["ColocatedPhases", "check_colocation", "colocated_phases"]


class ColocatedPhases:
    """Hands the devices to the rollout engine for each generation and back to the trainer after it.

    Args:
        rollout: the rollout engine (with ``sleep`` it must have a ``sleep()`` method).
        engines: training engines idle during generation (moved to host memory with ``offload``).
        sleep: free the rollout engine's weights and KV caches after each generation (and now).
        offload: keep ``engines``' weights and optimizer state in host memory while generating.
    """

    def __init__(self, rollout: object, engines: Sequence[TrainEngine], *, sleep: bool, offload: bool) -> None:
        if sleep and not isinstance(rollout, Sleeps):
            raise ValueError(
                f"rollout.sleep=true needs a rollout engine that can free its weights between phases; "
                f"{type(rollout).__name__} has no sleep(): use rollout.engine=hf or vllm, or set rollout.sleep=false"
            )
        self.rollout = rollout
        self.engines = list(engines) if offload else []
        self.sleep = sleep
        self.switch_s = 0.0
        """Seconds spent handing the devices over (offload, sleep, onload) since the last `pop_stats`."""
        if sleep:  # the trainer publishes its weights before any generation: version 0 is never served
            self._sleep()

    def _sleep(self) -> None:
        assert isinstance(self.rollout, Sleeps)  # checked in __init__
        self.rollout.sleep()

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """The generation phase: trainer state to the host before it; after it the rollout engine sleeps,
        then the trainer state comes back (in that order: the memory the engine frees is what it needs)."""
        began = time.perf_counter()
        left = began
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.offloaded())
            if self.sleep:
                stack.callback(self._sleep)  # exits run last-in first-out: sleep, then onload
            self.switch_s += time.perf_counter() - began
            try:
                yield
            finally:
                left = time.perf_counter()
        self.switch_s += time.perf_counter() - left

    def wrap(self, sample_fn: SampleFn) -> SampleFn:
        """``sample_fn`` run as a generation phase."""

        def sample(index: int) -> tuple[list[Any], Any]:
            with self.generating():
                return sample_fn(index)

        return sample

    def pop_stats(self) -> dict[str, float]:
        """``colocate/switch_s`` since the last call (the wake is part of the publish: ``weight_sync_s``)."""
        stats = {"colocate/switch_s": self.switch_s}
        self.switch_s = 0.0
        return stats


def check_colocation(config: Any) -> None:
    """Refuse ``rollout.sleep`` / ``offload_train_state_during_rollout`` where they cannot work, before any
    engine is built (disaggregated placement: `rollout.placement.rollout_actor_spec`)."""
    sleep, offload = bool(config.rollout.sleep), bool(config.offload_train_state_during_rollout)
    if not (sleep or offload):
        return
    names = " and ".join(
        n for n, on in (("rollout.sleep", sleep), ("offload_train_state_during_rollout", offload)) if on
    )
    if getattr(config, "async_rollouts", False):
        raise ValueError(
            f"{names} hand the devices between generation and training in turn; async_rollouts=true generates the "
            "next batch while the current one trains: set async_rollouts=false, or drop them"
        )
    on_host = [k for k in ("cpu_offload", "offload_when_idle") if getattr(config.engine, k)]
    if offload and on_host:
        raise ValueError(
            f"offload_train_state_during_rollout=true with engine.{on_host[0]}=true: the policy's weights and optimizer "
            "state are in host memory outside its calls already; drop one of them"
        )
    if sleep and config.rollout.engine == "vllm":
        from shardforge.rollout.vllm.sleep import require_sleep_mode  # vLLM's module only when vLLM is asked for

        require_sleep_mode("rollout.sleep=true with rollout.engine=vllm")


def colocated_phases(config: Any, rollout: object, engines: Sequence[TrainEngine]) -> ColocatedPhases | None:
    """The trainer's `ColocatedPhases` (None when neither option is on)."""
    if not (config.rollout.sleep or config.offload_train_state_during_rollout):
        return None
    return ColocatedPhases(
        rollout, engines, sleep=config.rollout.sleep, offload=config.offload_train_state_during_rollout
    )
