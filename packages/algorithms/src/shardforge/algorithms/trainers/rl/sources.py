"""Rollout sources: where a trainer's batches come from (`SyncRollouts`: on the main thread,
on-policy; `AsyncRollouts`: generated ahead in a background thread).

Asynchronous rollouts: batch k+1 is generated in a background thread while step k trains.

Timeline with ``max_staleness = s`` (policy step p = the weights after p optimiser steps)::

    main thread:  [wait b0][train step 0][publish p1][wait b1][train step 1][publish p2] ...
    generator:    [gen b0 @p0][gen b1 @p0 .......][gen b2 @p1 .................][gen b3 @p2] ...   (s = 1)

Batch k is generated with exactly the weights of policy step ``max(k - s, start)`` (see
`generation_policy_step`), and step k trains on it, so every batch is at most ``s`` steps
stale and which weights produce which batch never depends on thread timing: runs are
reproducible and the same under any data-parallel layout. The generator starts batch
``p + s`` as soon as policy ``p`` is published. ``s = 0`` reproduces the synchronous trainer
exactly (nothing overlaps); ``s = 1`` overlaps one batch's generation with one step's training.

The generator thread owns the rollout engine (its own model copy, refreshed from weight-sync
disk versions); it runs no collectives. The main thread publishes weights, and before it uses a
batch it agrees with every rank, through one tiny all-reduce, on whether some rank's generator
failed: then every rank raises (the failing rank its original exception), so no rank is left
waiting in a collective. Generation runs torch ops, which release the GIL, so on CPU it overlaps
with training as far as cores allow.

The embedded engine samples every seeded response (the trainers always seed) from its own generator
(`rollout.seeds`), not from the process-global torch RNG, so the trainer's own random draws (dropout)
cannot change what a batch samples, whatever the thread timing.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from shardforge.algorithms.trainers.rl.partial_stats import token_staleness_counts
from shardforge.mesh.collectives import all_reduce_max
from shardforge.rollout import RolloutEngine
from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.episodes.trajectory import Trajectory

__all__ = [
    "AsyncRollouts",
    "PublishFn",
    "RolloutGenerationError",
    "RolloutSource",
    "SampleFn",
    "SampledBatch",
    "SyncRollouts",
    "generation_policy_step",
    "raise_if_any_rank_failed",
]

T = TypeVar("T")
SampleFn = Callable[[int], tuple[list[Any], torch.Tensor]]
"""batch index -> (this rank's rollouts or workflow trajectories, their rewards), with the rollout
engine's current weights."""
PublishFn = Callable[[int | None], int]
"""weight-sync version (None = the first of this run) -> the published version (collective)."""


class RolloutGenerationError(RuntimeError):
    """Another rank's background rollout generator failed (the failing rank raises its own error)."""


@dataclass(kw_only=True, slots=True)
class SampledBatch:
    """One rank's share of a rollout batch."""

    index: int
    """Batch index = the step that trains on it."""
    policy_step: int
    """The weights that generated it: the policy after this many optimiser steps."""
    rollouts: list[Trajectory]
    """This rank's trajectories (a workflow's, token-in/token-out)."""
    rewards: torch.Tensor
    """[len(rollouts)] float32."""
    generate_s: float = 0.0
    """Time spent generating and scoring (in the background in async mode)."""
    wait_s: float = 0.0
    """Time the trainer waited for it."""
    stats: dict[str, float] = field(default_factory=dict)
    """Partial rollouts: this rank's per-token staleness counts (`rollout.partial_stats.token_staleness_counts`;
    the trainer sums them over ranks into the ``partial/*`` metrics)."""


def generation_policy_step(index: int, max_staleness: int, start: int) -> int:
    """The policy step whose weights generate batch ``index``: ``max(index - max_staleness, start)``.

    ``start`` is the first step of this process (0, or the resumed step): older weights exist only
    in the run that produced the checkpoint.
    """
    return max(index - max_staleness, start)


class RolloutSource(Protocol):
    """What a trainer's loop needs from a source of rollout batches."""

    def batch(self, index: int) -> SampledBatch: ...

    def publish(self, policy_step: int) -> None: ...

    def evaluate(self, fn: Callable[[RolloutEngine], T]) -> T: ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class SyncRollouts:
    """Synchronous, on-policy: batch k is generated on the main thread with the weights after step k."""

    def __init__(self, rollout: RolloutEngine, sample_fn: SampleFn, publish_fn: PublishFn) -> None:
        self.rollout, self.sample_fn, self.publish_fn = rollout, sample_fn, publish_fn
        self._version = publish_fn(None)
        rollout.update_weights(self._version)

    def batch(self, index: int) -> SampledBatch:
        started = time.perf_counter()
        rollouts, rewards = self.sample_fn(index)
        elapsed = time.perf_counter() - started
        return SampledBatch(index=index, policy_step=index, rollouts=rollouts, rewards=rewards, generate_s=elapsed)

    def publish(self, policy_step: int) -> None:
        self._version = self.publish_fn(self._version + 1)
        self.rollout.update_weights(self._version)

    def evaluate(self, fn: Callable[[RolloutEngine], T]) -> T:
        return fn(self.rollout)

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class AsyncRollouts:
    """Generates batches ahead in one background thread on a deterministic schedule.

    Args:
        rollout: the rollout engine (used only by the background thread once started).
        sample_fn: generates and scores batch ``index`` with the engine's current weights.
        publish_fn: publishes the trainer's weights as a weight-sync version (collective).
        max_staleness: s; batch k comes from policy step ``max(k - s, start)``.
        num_batches: the run's steps (no batch beyond is generated).
        start: the first step of this process.
        dp_rank, dp_size: this rank's data-parallel coordinates (checkpoint state is per dp rank).
        restored: `checkpoint_state` of the run that saved the checkpoint (None: none).
        device: the device the world group's collectives need (the trainer engine's device).
        chunks: partial rollouts: the `ChunkedGeneration` the engine was built with; between two chunks of a
            generation, switch to the newest published weights the batch may use (policy step <= its index) and continue the
            unfinished responses under them. The oldest token still comes from policy step
            ``max(k - s, start)``, so the staleness limit holds per token; which later chunk sees which newer
            weights depends on thread timing (every token records its version; checkpoints store them).
    """

    def __init__(
        self,
        *,
        rollout: RolloutEngine,
        sample_fn: SampleFn,
        publish_fn: PublishFn,
        max_staleness: int,
        num_batches: int,
        start: int,
        dp_rank: int,
        dp_size: int,
        restored: dict[str, Any] | None = None,
        device: torch.device | None = None,
        chunks: ChunkedGeneration | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0 (0 = on-policy, no overlap)")
        self.rollout = rollout
        self.sample_fn = sample_fn
        self.publish_fn = publish_fn
        self.max_staleness = max_staleness
        self.num_batches = num_batches
        self.start = start
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = device
        self.chunks = chunks
        self._lock = threading.Lock()  # _versions: written by the main thread, read between chunks
        self._versions = {start: publish_fn(None)}  # policy step -> weight-sync version
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-generator")
        self._futures: dict[Any, Future[Any]] = {}
        self._ready: dict[int, SampledBatch] = _decode(restored, start, dp_rank, dp_size)
        # Submissions wait in _pending until the next call that needs the generator, so an
        # evaluation requested right after a publish runs before the next batch's generation.
        self._pending = [
            (k, generation_policy_step(k, max_staleness, start))
            for k in range(start, min(start + max_staleness + 1, num_batches))
            if k not in self._ready
        ]

    @property
    def newest_policy_step(self) -> int:
        return max(self._versions)

    def version_of(self, policy_step: int) -> int:
        """The weight-sync version that holds policy step ``policy_step``."""
        return self._versions[policy_step]

    # ------------------------------------------------------------------ main-thread API
    def batch(self, index: int) -> SampledBatch:
        """Batch ``index`` (waits for it; raises on every rank if any rank's generator failed)."""
        self._flush()
        if index in self._ready:
            return self._ready.pop(index)
        if ("batch", index) not in self._futures:
            raise KeyError(f"batch {index} was never scheduled (scheduled: {sorted(self._futures)})")
        started = time.perf_counter()
        batch: SampledBatch = self._result(("batch", index))
        batch.wait_s = time.perf_counter() - started
        return batch

    def publish(self, policy_step: int) -> None:
        """Publish the trainer's weights as policy step ``policy_step`` (after step
        ``policy_step - 1``) and schedule the batch that first uses them. Collective."""
        version = self.publish_fn(self._versions[self.newest_policy_step] + 1)
        with self._lock:
            self._versions[policy_step] = version
        index = policy_step + self.max_staleness
        if index < self.num_batches:
            self._pending.append((index, policy_step))

    def evaluate(self, fn: Callable[[RolloutEngine], T]) -> T:
        """Run ``fn(rollout engine)`` in the generator thread with the newest published weights
        (before any batch scheduled after that publish) and wait for it."""
        newest = self.newest_policy_step
        self._futures[("eval", newest)] = self._executor.submit(self._run_eval, fn, newest)
        self._flush()
        result: T = self._result(("eval", newest))
        return result

    def checkpoint_state(self) -> dict[str, Any]:
        """The prefetched batches a resumed run cannot regenerate (their weights predate the
        checkpoint): every dp rank's share of batches ``next .. next + s - 1``, gathered so that
        every rank returns the same JSON-able dict. Waits for them; collective."""
        next_step = self.newest_policy_step
        mine = [
            _encode(self.batch_peek(k)) for k in range(next_step, min(next_step + self.max_staleness, self.num_batches))
        ]
        gathered: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(gathered, (self.dp_rank, mine))
        else:
            gathered = [(self.dp_rank, mine)]
        by_rank = dict(reversed(gathered))  # ranks of one dp group hold the same batches
        return {"dp_size": self.dp_size, "ranks": [by_rank[r] for r in range(self.dp_size)]}

    def batch_peek(self, index: int) -> SampledBatch:
        """Like `batch`, but the batch stays available for a later `batch(index)`."""
        batch = self.batch(index)
        self._ready[index] = batch
        return batch

    def close(self) -> None:
        """Stop the generator (waits for a batch in progress; drops queued ones)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _flush(self) -> None:
        for index, policy_step in self._pending:
            self._futures[("batch", index)] = self._executor.submit(self._generate, index, policy_step)
        self._pending.clear()

    def _generate(self, index: int, policy_step: int) -> SampledBatch:  # generator thread
        started = time.perf_counter()
        if self.chunks is not None:
            policy_step = self._start_step(policy_step)
        self.rollout.update_weights(self._versions[policy_step])
        refreshing = self.chunks.refreshing(lambda: self._refresh(index)) if self.chunks else contextlib.nullcontext()
        with refreshing:
            rollouts, rewards = self.sample_fn(index)
        with self._lock:
            steps = {version: step for step, version in self._versions.items()}
        return SampledBatch(
            index=index,
            policy_step=policy_step,
            rollouts=rollouts,
            rewards=rewards,
            generate_s=time.perf_counter() - started,
            stats=token_staleness_counts(rollouts, index, steps) if self.chunks is not None else {},
        )

    def _start_step(self, policy_step: int) -> int:  # generator thread
        """The policy a batch starts with: the scheduled one, or the newer one the previous batch was continued
        under (weight versions only move forward; the batch is then fresher than the limit asks)."""
        with self._lock:
            serving = [p for p, v in self._versions.items() if v == self.rollout.version]
        return max([policy_step, *serving])

    def _refresh(self, index: int) -> None:  # generator thread, between two chunks of batch `index`
        with self._lock:
            version = self._versions[max(p for p in self._versions if p <= index)]
        if version != self.rollout.version:
            self.rollout.update_weights(version)

    def _run_eval(self, fn: Callable[[RolloutEngine], T], policy_step: int) -> T:  # generator thread
        self.rollout.update_weights(self._versions[policy_step])
        return fn(self.rollout)

    def _result(self, key: Any) -> Any:
        """Wait for a job; agree across all ranks whether any failed, and raise on all if so."""
        future = self._futures.pop(key)
        error: BaseException | None = None
        value = None
        try:
            value = future.result()
        except BaseException as exc:
            error = exc
        raise_if_any_rank_failed(error, f"{key[0]} {key[1]}", self.device)
        return value


def raise_if_any_rank_failed(error: BaseException | None, what: str, device: torch.device | None) -> None:
    """Agree across all ranks (one tiny all-reduce) whether some rank's background generator failed producing
    ``what``; then every rank raises: the failing ones their ``error``, the others a `RolloutGenerationError`
    naming the failing ranks and the first cause. Collective (identity without a process group)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    (failed,) = all_reduce_max(0.0 if error is None else 1.0, group=world, device=device)
    if failed == 0.0:
        return
    messages: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failures = {rank: m for rank, m in enumerate(messages) if m is not None}
    raise RolloutGenerationError(
        f"the background rollout generator failed on rank(s) {sorted(failures)} while producing {what}: "
        f"{next(iter(failures.values()))}"
    )


def _encode(batch: SampledBatch) -> dict[str, Any]:
    rollouts = [r.to_state() for r in batch.rollouts]
    # float32 -> Python float -> JSON (repr) round-trips exactly.
    return {
        "index": batch.index,
        "policy_step": batch.policy_step,
        "rewards": batch.rewards.tolist(),
        "rollouts": rollouts,
        "stats": batch.stats,
    }


def _decode(state: dict[str, Any] | None, start: int, dp_rank: int, dp_size: int) -> dict[int, SampledBatch]:
    if not state:
        return {}
    if state.get("dp_size") != dp_size:
        warnings.warn(
            f"the checkpoint's prefetched rollout batches were made by {state.get('dp_size')} data-parallel ranks, "
            f"this run has {dp_size}: they are regenerated with the checkpoint's weights (staleness 0 for them)",
            stacklevel=3,
        )
        return {}
    batches = {}
    for item in state["ranks"][dp_rank]:
        if item["index"] < start:
            continue
        batches[item["index"]] = SampledBatch(
            index=item["index"],
            policy_step=item["policy_step"],
            rollouts=[Trajectory.from_state(r) for r in item["rollouts"]],
            rewards=torch.tensor(item["rewards"], dtype=torch.float32),
            stats=item.get("stats", {}),
        )
    return batches
