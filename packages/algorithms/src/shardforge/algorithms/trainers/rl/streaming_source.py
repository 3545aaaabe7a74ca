"""The streaming batch source of a trainer (``streaming_rollouts: true``, issue 41): `StreamingRollouts` driven by
the trainer's rollout engine and weight publisher.

What it adds to `StreamingRollouts` (which knows neither engines nor ranks):

- Weights: policy step p is published as a weight-sync version (collective, main thread); the generator thread
  loads, before each group, the newest version its admission allowed, never an older one than the engine serves
  (weights only move forward, as vLLM and `AsyncRollouts`' partial mode require), so every trajectory is at least
  as fresh as its recorded start version and its tokens carry the versions that sampled them (the decoupled loss
  and the rollout correction use those, exactly as with `AsyncRollouts`).
- Partial rollouts (``rollout.partial_rollouts``, the engine generates in chunks: `rollout.chunked`): at every chunk
  boundary a generate call switches to the newest published weights (AReaL's interruption at a weight update) and its
  unfinished responses continue under them; with several workers the switch waits until every call in flight is at a
  chunk boundary (or done), so no chunk runs under two versions. A group keeps its start version (the staleness bound
  counts from it); every token keeps the version that sampled it (``partial/*``: per-token staleness, the share of
  responses continued under newer weights). A call whose groups were all released (too stale for any later batch)
  stops at its next chunk boundary.
- Held-out evaluation on the main thread, between two generate calls (none in flight), with the newest weights.
- Generator workers (``workers``, ``rollout.streaming_workers``): each has one generate call in flight, of up to
  ``ceil(local / workers)`` prompts; calls overlap (for an engine that serves concurrent requests), but a weight
  switch waits until no call is in flight, so every call runs under one weight version.
- Ranks: each data-parallel rank streams its own share of every global batch (`sampling.workflow_group_fn`) and
  trains on its own first finished groups; a failing generator raises on every rank (`raise_if_any_rank_failed`).
  Checkpoint state is every dp rank's, gathered; a resumed run with another data-parallel size shares the
  positions out again (`streaming_resume.rank_share`).
- Records: each rank appends what each batch trained on (global prompt positions, in training and in finish order,
  and start versions) to ``output_dir/streaming/rank{R}.jsonl``; lines of batches at or after a resumed run's start
  are dropped first, so the file is the run's history. A global prompt position is ``batch * prompts_per_step +
  slot`` of the seeded sampler's draws.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardforge.algorithms.trainers.rl.partial_stats import token_staleness_counts
from shardforge.algorithms.trainers.rl.sources import PublishFn, SampledBatch, raise_if_any_rank_failed
from shardforge.algorithms.trainers.rl.streaming import GroupsFn, KeepFn, StreamBatchInfo, StreamingRollouts
from shardforge.algorithms.trainers.rl.streaming_resume import rank_share
from shardforge.rollout import RolloutEngine
from shardforge.rollout.chunked import ChunkedGeneration

__all__ = ["StreamingSource", "stream_stats"]

T = TypeVar("T")


class StreamingSource:
    """A `RolloutSource` that streams complete prompt groups under a staleness bound (see the module docstring).

    Args:
        rollout: the rollout engine (the generator thread's, and evaluation's between groups).
        groups_fn: this rank's prompt numbers -> their groups and rewards, in one generation round
            (`sampling.workflow_groups_fn`); a call takes up to ``prompts_per_step / dp_size`` prompts (as many as
            the staleness bound admits): the embedded engine batches them, and they finish together.
        publish_fn: publishes the trainer's weights as a weight-sync version (collective).
        prompts_per_step: global prompts per step (each rank streams ``prompts_per_step / dp_size`` per batch).
        max_staleness, num_batches, start: as `StreamingRollouts`.
        dp_rank, dp_size: this rank's data-parallel coordinates.
        restored: `checkpoint_state` of the run that saved the checkpoint (None: none).
        device: the device the world group's collectives need.
        record_dir: where the per-rank batch records go (None: not recorded).
        workers: generator threads (``rollout.streaming_workers``); ``groups_fn`` must then be safe to call from
            several threads at once (see the module docstring).
        keep_fn, max_rounds: dynamic sampling (`StreamingRollouts`): each rank judges its own finished groups.
        chunks: partial rollouts: the `ChunkedGeneration` the engine was built with (see the module docstring);
            None: every generate call runs under one weight version.
        late_groups: what a group unfinished at the last batch the bound allows does (`streaming_late`).
    """

    checkpoint_key = "streaming_rollouts"
    """The key of this source's state in the checkpoint's extra state."""

    def __init__(
        self,
        *,
        rollout: RolloutEngine,
        groups_fn: GroupsFn,
        publish_fn: PublishFn,
        prompts_per_step: int,
        max_staleness: int,
        num_batches: int,
        start: int,
        dp_rank: int,
        dp_size: int,
        restored: dict[str, Any] | None = None,
        device: torch.device | None = None,
        record_dir: Path | None = None,
        workers: int = 1,
        keep_fn: KeepFn | None = None,
        max_rounds: int = 1,
        chunks: ChunkedGeneration | None = None,
        late_groups: str = "defer",
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1 (generator threads of the streaming source)")
        self.rollout, self.groups_fn, self.publish_fn = rollout, groups_fn, publish_fn
        self.local = prompts_per_step // dp_size
        self.prompts_per_step, self.max_staleness = prompts_per_step, max_staleness
        self.dp_rank, self.dp_size, self.device = dp_rank, dp_size, device
        self._engine = threading.Condition()  # guards the weights: calls in flight, an evaluation, a switch
        self._active = 0  # generate calls in flight
        self._exclusive = False  # an evaluation holds the engine
        self.max_active = 0  # the most generate calls that were in flight at once (observed; tests)
        self._paused = 0  # partial rollouts: calls waiting at a chunk boundary for a weight switch
        self._versions = {start: publish_fn(None)}  # policy step -> weight-sync version
        self._newest = self._versions[start]  # the newest published weight-sync version (read between chunks)
        self.chunks = chunks
        self._wanted = start  # the newest policy step the generator may serve (it only grows)
        self._record = None
        if record_dir is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self._record = record_dir / f"rank{rank}.jsonl"
            _truncate_records(self._record, start)
            world = dist.get_world_size() if dist.is_initialized() else 1
            if rank == 0:  # a run saved with more ranks: their files lose the batches this run trains again too
                for path in record_dir.glob("rank*.jsonl"):
                    if path.stem[4:].isdigit() and int(path.stem[4:]) >= world:
                        _truncate_records(path, start)
        self.stream = StreamingRollouts(
            group_fn=_unused, load_weights=self._load, publish_fn=self._publish, prompts_per_step=self.local,
            max_staleness=max_staleness, num_batches=num_batches, start=start,
            restored=rank_share(restored, dp_rank, dp_size, prompts_per_step), groups_fn=self._groups, workers=workers,
            groups_per_call=-(-self.local // workers), keep_fn=keep_fn, max_rounds=max_rounds,
            late_groups=late_groups,
        )  # fmt: skip
        self._hooks = contextlib.ExitStack()
        if chunks is not None:  # for the source's lifetime: every worker's calls (an evaluation's are not interrupted)
            self._hooks.enter_context(chunks.refreshing(self._between_chunks))

    def global_position(self, q: int) -> int:
        """This rank's prompt number ``q`` as a global prompt position (``batch * prompts_per_step + slot``)."""
        index, row = divmod(q, self.local)
        return index * self.prompts_per_step + self.dp_rank + self.dp_size * row

    # ------------------------------------------------------------------ main-thread API
    def batch(self, index: int) -> SampledBatch:
        """The next batch: this rank's first ``prompts_per_step / dp_size`` complete groups (raises on every rank
        if any rank's generator failed)."""
        error: BaseException | None = None
        try:
            batch = self.stream.batch(index)
        except BaseException as exc:
            error = exc
        raise_if_any_rank_failed(error, f"batch {index}", self.device)
        info = self.stream.infos[-1]
        batch.stats = stream_stats(batch.stats, info, index, self.max_staleness)
        if self.chunks is not None:  # per-token staleness (partial/*): the policy step behind each token's version
            steps = {version: step for step, version in self._versions.items()}
            batch.stats |= token_staleness_counts(batch.rollouts, index, steps)
        if self._record is not None:
            self._record.parent.mkdir(parents=True, exist_ok=True)
            with self._record.open("a") as f:
                f.write(json.dumps(self._describe(index, info)) + "\n")
        return batch

    def publish(self, policy_step: int) -> None:
        self.stream.publish(policy_step)

    def evaluate(self, fn: Callable[[RolloutEngine], T]) -> T:
        """``fn(rollout engine)`` on this thread while no generate call is in flight, with the newest published
        weights."""
        with self._engine:
            self._engine.wait_for(lambda: not self._exclusive and self._active == 0)
            self._exclusive = True
        try:
            self._serve(self._versions[max(self._versions)])
            return fn(self.rollout)
        finally:
            with self._engine:
                self._exclusive = False
                self._engine.notify_all()

    def checkpoint_state(self) -> dict[str, Any]:
        """Every dp rank's prompt numbers in flight or finished-unused and next new one (collective)."""
        mine = self.stream.checkpoint_state()
        gathered: list[Any] = [(self.dp_rank, mine)]
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (self.dp_rank, mine))
        by_rank = dict(reversed(gathered))  # ranks of one dp group hold the same state
        return {"dp_size": self.dp_size, "ranks": [by_rank[r] for r in range(self.dp_size)]}

    def close(self) -> None:
        self.stream.close()
        self._hooks.close()

    # ------------------------------------------------------------------ internals
    def _publish(self, policy_step: int) -> None:  # main thread, collective
        version = self.publish_fn(self._versions[max(self._versions)] + 1)
        self._versions[policy_step] = version
        self._newest = version

    def _load(self, policy_step: int) -> None:  # generator thread: remembered, applied before the next group
        self._wanted = max(self._wanted, policy_step)

    def _groups(self, positions: list[int]) -> list[tuple[list[Any], torch.Tensor]]:  # a generator thread
        with self._engine:
            # newer weights wait until no call is in flight (one version per call); an evaluation waits for none
            self._engine.wait_for(
                lambda: not self._exclusive and (self._active == 0 or self.rollout.version >= self._target())
            )
            self._serve(self._target())
            self._active += 1
            self.max_active = max(self.max_active, self._active)
        try:
            return self.groups_fn(positions)
        finally:
            with self._engine:
                self._active -= 1
                self._engine.notify_all()

    def _between_chunks(self) -> bool:  # inside a generate call, after a chunk that left unfinished rows
        """Partial rollouts: stop a call no batch can use any more; otherwise switch to the newest published weights
        once every call in flight is at a chunk boundary (the interruption), and continue."""
        if not self.stream.in_call():  # an evaluation on the main thread: never interrupted
            return False
        if self.stream.call_released():
            return True
        with self._engine:
            if self.rollout.version >= self._newest:
                return False
            self._paused += 1
            self._engine.notify_all()
            self._engine.wait_for(lambda: self.rollout.version >= self._newest or self._paused == self._active)
            self._serve(self._newest)
            self._paused -= 1
            self._engine.notify_all()
        return False

    def _target(self) -> int:
        return self._versions[self._wanted]

    def _serve(self, version: int) -> None:
        if self.rollout.version < version:  # never back: an evaluation may have loaded newer weights
            self.rollout.update_weights(version)

    def _describe(self, index: int, info: StreamBatchInfo) -> dict[str, Any]:
        return {
            "batch": index,
            "positions": [self.global_position(q) for q in info.positions],
            "finish_order": [self.global_position(q) for q in info.finish_order],
            "start_versions": info.start_versions,
            "filtered": [self.global_position(q) for q in info.filtered],
        }


def stream_stats(base: dict[str, float], info: StreamBatchInfo, index: int, max_staleness: int) -> dict[str, float]:
    """This rank's raw streaming statistics of batch ``index`` (sums and extremes; `step_stats.add_stream_stats`
    reduces them over ranks): staleness sum/max and a count per staleness 0..max_staleness (the histogram), start
    versions' extremes (the version spread), groups in flight, idle fractions."""
    staleness = [index - v for v in info.start_versions]
    stats = {
        "groups": float(len(staleness)),
        "ranks": 1.0,
        "staleness_sum": float(sum(staleness)),
        "staleness_max": float(max(staleness)),
        "start_version_max": float(max(info.start_versions)),
        "start_version_min": float(min(info.start_versions)),
        "in_flight": base["stream/in_flight"],
        "trainer_idle_frac_sum": base["stream/trainer_idle_frac"],
        "generator_idle_frac_sum": base["stream/generator_idle_frac"],
        "regenerated": base["stream/regenerated"],
        "filtered_all_pass": base["stream/filtered_all_pass"],
        "filtered_all_fail": base["stream/filtered_all_fail"],
        "cap_hit": base["stream/cap_hit"],
    }
    for s in range(max_staleness + 1):
        stats[f"staleness_{s}"] = float(sum(1 for x in staleness if x == s))
    return stats


def _unused(position: int) -> tuple[list[Any], torch.Tensor]:
    raise AssertionError("StreamingSource generates through groups_fn")


def _truncate_records(path: Path, start: int) -> None:
    """Drop the records of batches >= ``start`` (a resumed run trains them again)."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["batch"] < start]
    path.write_text("".join(line + "\n" for line in lines))
