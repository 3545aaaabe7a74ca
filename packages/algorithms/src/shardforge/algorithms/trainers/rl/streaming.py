"""Streaming rollouts (AReaL-style fully asynchronous RL): a background generator produces prompt groups
continuously (one per call, or as many as the bound admits with ``groups_fn``), and each trainer step takes
the first ``prompts_per_step`` COMPLETE groups to finish.

Staleness (policy step p = the weights after p optimiser steps; a group's *start version* is the policy
step loaded when its generation began):

- Admission (AReaL's capacity rule): the generator starts prompt number ``n`` (0-based, counted from the
  start of this process) only while ``n < (max_staleness + newest_policy_step - start + 1) * prompts_per_step``;
  otherwise the submission waits for the next publish. At most ``(max_staleness + 1) * prompts_per_step``
  prompts are therefore in flight or finished-but-unused at any time.
- Consumption: batch k takes finished groups with start version ``k - max_staleness`` first (they would
  break the bound at step k + 1), then the earliest finished. A group still generating when batch k is the last one
  its bound allows (start version ``k - max_staleness``) is LATE; ``late_groups`` (`streaming_late`) decides: the
  batch waits for it (``wait``, and ``defer``'s second attempt), or it is released: its prompt is started again
  (``defer``: together with the other deferred ones, later; ``regenerate``: at once) and the late result dropped
  (``stream/regenerated``), so it stops holding a place in flight. With partial rollouts the generate call of released
  groups stops at its next chunk boundary (`call_released`). A finished group whose staleness already exceeds the
  bound (only possible when a short batch broke the room the admission rule leaves) is released the same way, so no
  trained group is ever more than ``max_staleness`` steps stale and no prompt is dropped.
- Dynamic sampling (``keep_fn``): a group is judged when it finishes; a dropped one (no learning signal) frees its
  place in flight at once, so a fresh prompt starts, and the trainer waits for ``prompts_per_step`` KEPT groups.
  Generation is capped at ``max_rounds`` x the admission limit (every prompt started, kept or not); when the cap
  stops the generator with fewer kept groups than a batch and nothing in flight, the batch trains on the groups it
  has (``stream/cap_hit``; with none, on the last dropped group, whose group advantages are 0). Dropped positions
  are consumed (recorded in ``StreamBatchInfo.filtered``), never regenerated.
- Within a batch, groups are ordered by prompt position (the completion order is recorded in
  ``StreamBatchInfo.finish_order``), so ``max_staleness = 0`` gives exactly the synchronous batches.

Checkpoints (`checkpoint_state`): the prompt positions in flight or finished-but-unused are saved (not
their tokens) together with the next prompt position; a resumed run regenerates them first with the
checkpoint's weights, so no prompt is dropped or repeated. What a resumed run trains on is the same SET of
prompts in the same recorded order of positions; the tokens of regenerated groups differ from the ones the
killed run had in flight unless generation is seeded per prompt. With partial rollouts the same holds: a group
interrupted mid-generation is regenerated from scratch on restore rather than resumed, because its tokens so far came
from weights older than the checkpoint (a resumed process has only the checkpoint's) and live inside an episode
(multi-turn state, tool and environment sessions) that cannot be saved in general; regenerated, it starts under the
checkpoint's weights, staleness 0 (``docs/packages/algorithms-grpo.md``, streaming).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardforge.algorithms.trainers.rl.sources import SampledBatch
from shardforge.algorithms.trainers.rl.streaming_late import PromptOrder
from shardforge.rollout.episodes.trajectory import Trajectory

__all__ = ["GroupFn", "GroupsFn", "KeepFn", "StreamBatchInfo", "StreamingRollouts"]

GroupFn = Callable[[int], tuple[list[Trajectory], torch.Tensor]]
"""prompt position -> (that prompt's group of trajectories, their rewards), with the engine's current weights."""
GroupsFn = Callable[[list[int]], list[tuple[list[Trajectory], torch.Tensor]]]
"""prompt positions -> each one's (group, rewards), generated in one call (an engine without continuous batching)."""
KeepFn = Callable[[list[Trajectory]], str | None]
"""A finished group -> None to keep it, or why it is dropped (dynamic sampling: ``all_pass`` / ``all_fail``)."""


@dataclass(slots=True)
class _Group:
    position: int
    start_version: int
    rollouts: list[Trajectory] = field(default_factory=list)
    rewards: torch.Tensor | None = None
    finished: int = -1  # completion rank (0, 1, ...); -1 while in flight
    error: BaseException | None = None


@dataclass(kw_only=True, slots=True)
class StreamBatchInfo:
    """What the streaming source recorded about one batch."""

    positions: list[int]
    """Prompt positions of the batch's groups (training order)."""
    finish_order: list[int]
    """The same positions in the order their groups finished."""
    start_versions: list[int]
    """Start version (policy step) of each group, in training order."""
    filtered: list[int] = field(default_factory=list)
    """Positions dropped by ``keep_fn`` since the previous batch (consumed: never trained, never regenerated)."""


class StreamingRollouts:
    """A `RolloutSource` that streams groups from a background generator under a staleness bound.

    Args:
        group_fn: generates and scores one prompt group (runs in the generator thread).
        load_weights: ``policy_step -> None``; loads that policy's weights into the rollout engine (generator
            thread, between two groups).
        publish_fn: ``policy_step -> None``; publishes the trainer's weights (main thread, collective).
        prompts_per_step: groups per batch.
        max_staleness: s >= 0.
        num_batches: the run's steps.
        start: the first step of this process (0, or the resumed step).
        restored: `checkpoint_state` of the run that saved the checkpoint (None: none).
        workers: generator threads, each generating one group at a time (> 1 only for an engine that serves
            concurrent requests, e.g. a continuous-batching server; weights are loaded once per version, under a lock).
        groups_fn: generates several groups in one call (an engine without continuous batching, e.g. embedded HF
            generate, where one call of many rows costs about as much as one of few); then each worker admits up
            to ``groups_per_call`` prompts at once (as many as the bound allows, at least one) and they finish
            together. ``group_fn`` is not called.
        groups_per_call: see ``groups_fn``.
        keep_fn: dynamic sampling: judges each finished group (see the module docstring); None keeps every group.
        max_rounds: with ``keep_fn``, prompts started are capped at ``max_rounds`` x the admission limit.
        late_groups: what happens to a group that has not finished when the last batch the bound allows is assembled
            (`streaming_late`: ``wait``, ``defer`` or ``regenerate``).
    """

    def __init__(
        self,
        *,
        group_fn: GroupFn,
        load_weights: Callable[[int], None],
        publish_fn: Callable[[int], None],
        prompts_per_step: int,
        max_staleness: int,
        num_batches: int,
        start: int = 0,
        restored: dict[str, Any] | None = None,
        workers: int = 1,
        groups_fn: GroupsFn | None = None,
        groups_per_call: int = 1,
        keep_fn: KeepFn | None = None,
        max_rounds: int = 1,
        late_groups: str = "defer",
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step={prompts_per_step} must be >= 1")
        if max_rounds < 1:
            raise ValueError(f"max_rounds={max_rounds} must be >= 1")
        if groups_per_call < 1:
            raise ValueError(f"groups_per_call={groups_per_call} must be >= 1")
        self.group_fn, self.load_weights, self.publish_fn = group_fn, load_weights, publish_fn
        self.groups_fn, self.groups_per_call = groups_fn, groups_per_call if groups_fn is not None else 1
        self.prompts_per_step, self.max_staleness = prompts_per_step, max_staleness
        self.num_batches, self.start = num_batches, start
        self._cond = threading.Condition()
        self._version = start  # newest published policy step
        self._loaded: int | None = None  # generator thread only
        restored = restored or {}
        self._order = PromptOrder(
            late_groups=late_groups, restored=restored.get("regenerate", []),
            next_position=int(restored.get("next_position", start * prompts_per_step)),
            end=num_batches * prompts_per_step, flush_at=prompts_per_step,
        )  # fmt: skip
        self._submitted = 0  # prompts started by this process and not dropped (admission counter)
        self.keep_fn, self.max_rounds = keep_fn, max_rounds
        self._started = 0  # prompts started by this process, dropped ones included (the dynamic-sampling cap)
        self._filtered: dict[str, int] = {}  # dropped groups by reason (cumulative)
        self._filtered_positions: list[int] = []  # dropped since the last batch
        self._last_dropped: _Group | None = None  # a cap-hit batch with no kept group trains on it
        self._total = (num_batches - start) * prompts_per_step  # prompts this process trains on
        self._groups: dict[int, _Group] = {}  # in flight or finished-unused, by position
        self._finished = 0
        self._stop = False
        self._gen_busy_s = 0.0
        self._gen_idle_s = 0.0
        self._regenerated = 0
        self._trainer_wait_s = 0.0
        self._trainer_first: float | None = None  # when the first batch() call began
        self.infos: list[StreamBatchInfo] = []
        self._load_lock = threading.Lock()
        self._call = threading.local()  # a generator thread's groups in flight (`call_released`)
        self._threads = [
            threading.Thread(target=self._run, name=f"stream-generator-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ main-thread API
    def batch(self, index: int) -> SampledBatch:
        """The next batch (waits until enough complete groups exist)."""
        started = time.perf_counter()
        if self._trainer_first is None:
            self._trainer_first = started
        bound = index - self.max_staleness
        with self._cond:
            while True:
                self._raise_failed()
                stale = [g for g in self._groups.values() if g.finished >= 0 and g.start_version < bound]
                for g in stale:  # would break the bound: released, its prompt started again (`streaming_late`)
                    self._release(g)
                if stale:
                    self._cond.notify_all()
                done = [g for g in self._groups.values() if g.finished >= 0]
                urgent = [g for g in done if g.start_version == bound]  # would break the bound at step index + 1
                need = self.prompts_per_step
                if len(done) >= need and not self._late_in_flight(bound, need):
                    break
                cap_hit = self._cap_hit(len(done))
                if cap_hit:
                    need = len(done)
                    if not done:  # nothing kept: train on the last dropped group (advantage 0 for group estimators)
                        assert self._last_dropped is not None
                        done = [self._last_dropped]
                        self._last_dropped.finished, self._finished = self._finished, self._finished + 1
                        self._groups[self._last_dropped.position] = self._last_dropped
                        self._filtered_positions.remove(self._last_dropped.position)
                        self._last_dropped, need = None, 1
                    break
                self._cond.wait()
            chosen = sorted(urgent, key=lambda g: (g.start_version, g.finished))[:need]
            taken = {g.position for g in chosen}
            rest = sorted((g for g in done if g.position not in taken), key=lambda g: g.finished)
            chosen += rest[: need - len(chosen)]
            for g in chosen:
                del self._groups[g.position]
                self._order.done(g.position)
            # In flight but started too early for any later batch (a late group this batch did not wait for): released,
            # its prompt started again (`streaming_late`) and its call's result dropped, instead of holding its place
            # until it finishes stale.
            too_old = index + 1 - self.max_staleness
            for g in [g for g in self._groups.values() if g.finished < 0 and g.start_version < too_old]:
                self._release(g)
            in_flight = sum(1 for g in self._groups.values() if g.finished < 0)
            gen_busy, gen_idle = self._gen_busy_s, self._gen_idle_s
            regenerated = self._regenerated
            filtered, self._filtered_positions = self._filtered_positions, []
            counts = dict(self._filtered)
            self._cond.notify_all()
        now = time.perf_counter()
        wait_s = now - started
        self._trainer_wait_s += wait_s
        finish_order = [g.position for g in sorted(chosen, key=lambda g: g.finished)]
        chosen.sort(key=lambda g: g.position)
        staleness = torch.tensor([float(index - g.start_version) for g in chosen])
        self.infos.append(
            StreamBatchInfo(
                positions=[g.position for g in chosen],
                finish_order=finish_order,
                start_versions=[g.start_version for g in chosen],
                filtered=filtered,
            )
        )
        rewards = [g.rewards for g in chosen if g.rewards is not None]
        return SampledBatch(
            index=index,
            policy_step=min(g.start_version for g in chosen),
            rollouts=[r for g in chosen for r in g.rollouts],
            rewards=torch.cat(rewards) if rewards else torch.zeros(0),
            wait_s=wait_s,
            generate_s=gen_busy,
            stats={
                "stream/staleness_mean": float(staleness.mean()),
                "stream/staleness_max": float(staleness.max()),
                "stream/in_flight": float(in_flight),
                "stream/trainer_idle_frac": self._trainer_wait_s / max(now - self._trainer_first, 1e-9),
                "stream/generator_idle_frac": gen_idle / max(gen_idle + gen_busy, 1e-9),
                "stream/regenerated": float(regenerated),
                "stream/filtered_all_pass": float(counts.get("all_pass", 0)),
                "stream/filtered_all_fail": float(counts.get("all_fail", 0)),
                "stream/cap_hit": float(need < self.prompts_per_step),
            },
        )

    def publish(self, policy_step: int) -> None:
        """Publish the trainer's weights as ``policy_step``; new submissions start under them."""
        self.publish_fn(policy_step)
        with self._cond:
            self._version = policy_step
            self._cond.notify_all()

    def checkpoint_state(self) -> dict[str, Any]:
        """Prompt positions in flight or finished-unused (regenerated on resume) and the next new position."""
        with self._cond:
            positions = sorted([*self._groups, *self._order.pending()])
            return {"regenerate": positions, "next_position": self._order.next_position}

    def in_call(self) -> bool:
        """Whether the calling thread is a generator thread inside a generate call (partial rollouts' chunk hook)."""
        return bool(getattr(self._call, "groups", None))

    def call_released(self) -> bool:
        """Whether every group of the calling generator thread's call was released (too stale for any later batch):
        its result will be dropped, so partial rollouts stop the call at the next chunk boundary."""
        groups: list[_Group] = getattr(self._call, "groups", None) or []
        with self._cond:
            return bool(groups) and all(self._groups.get(g.position) is not g for g in groups)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    # ------------------------------------------------------------------ generator thread
    def _capacity_left(self) -> bool:
        limit = (self.max_staleness + self._version - self.start + 1) * self.prompts_per_step
        return self._submitted < min(limit, self._total) and self._started < self.max_rounds * limit

    def _release(self, g: _Group) -> None:
        """Give up ``g`` (too stale for any later batch): its prompt is started again (`streaming_late`)."""
        del self._groups[g.position]
        self._order.release(g.position)
        self._submitted -= 1
        self._started -= 1  # not a new prompt: outside the dynamic-sampling cap
        self._regenerated += 1

    def _late_in_flight(self, bound: int, need: int) -> bool:
        """Whether batch ``bound + max_staleness`` must still wait for a late group: one in flight that started under
        ``bound`` (no later batch may take it) and that the policy waits for (``wait``: every one; ``defer``: a second
        attempt). The admission rule leaves room for all of them in this batch; should there be more (dynamic
        sampling's cap trained a short batch), none is waited for and the extra are released."""
        late = [g for g in self._groups.values() if g.start_version <= bound]
        return len(late) <= need and any(g.finished < 0 and self._order.waits_for(g.position) for g in late)

    def _cap_hit(self, done: int) -> bool:
        """Dynamic sampling's cap stops the generator with fewer kept groups than a batch and none in flight."""
        if self.keep_fn is None or self._capacity_left():
            return False
        in_flight = any(g.finished < 0 for g in self._groups.values())
        last = self._last_dropped  # a placeholder only while no record has named it filtered yet
        return not in_flight and (done > 0 or (last is not None and last.position in self._filtered_positions))

    def _run(self) -> None:
        while True:
            idle = time.perf_counter()
            with self._cond:
                while not self._stop and not self._capacity_left():
                    self._cond.wait()
                if self._stop:
                    return
                version = self._version
                groups: list[_Group] = []
                while self._capacity_left() and len(groups) < self.groups_per_call:
                    position = self._order.take()
                    group = _Group(position=position, start_version=version)
                    self._groups[position] = group
                    self._submitted += 1
                    self._started += 1
                    groups.append(group)
                self._gen_idle_s += time.perf_counter() - idle
            busy = time.perf_counter()
            error: BaseException | None = None
            self._call.groups = groups
            try:
                with self._load_lock:
                    if self._loaded is None or self._loaded < version:  # versions only move forward
                        self.load_weights(version)
                        self._loaded = version
                if self.groups_fn is not None:
                    results = self.groups_fn([g.position for g in groups])
                else:
                    results = [self.group_fn(groups[0].position)]
                for g, (rollouts, rewards) in zip(groups, results, strict=True):
                    g.rollouts, g.rewards = rollouts, rewards
                dropped = {g.position: self.keep_fn(g.rollouts) for g in groups} if self.keep_fn is not None else {}
            except BaseException as exc:  # reported to the trainer by batch()
                error, dropped = exc, {}
            finally:
                self._call.groups = None
            with self._cond:
                self._gen_busy_s += time.perf_counter() - busy
                for g in groups:
                    if self._groups.get(g.position) is not g:  # released while in flight (too stale): dropped
                        continue
                    reason = dropped.get(g.position)
                    if reason is not None:  # no learning signal: its place in flight goes to a fresh prompt
                        del self._groups[g.position]
                        self._order.done(g.position)
                        self._submitted -= 1
                        self._filtered[reason] = self._filtered.get(reason, 0) + 1
                        self._filtered_positions.append(g.position)
                        self._last_dropped = g
                        continue
                    g.error = error
                    g.finished = self._finished
                    self._finished += 1
                self._cond.notify_all()
                if error is not None:
                    return

    def _raise_failed(self) -> None:
        for g in self._groups.values():
            if g.error is not None:
                raise RuntimeError(f"the streaming generator failed on prompt {g.position}") from g.error
