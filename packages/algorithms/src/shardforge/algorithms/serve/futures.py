"""The service's futures: every model-touching request is queued and answered later through
``/api/v1/retrieve_future``, as the Tinker SDK expects (it polls until the answer is not ``try_again``).

``workers`` threads run the queued work. A job has a lane (a training model's id) or none: jobs of one lane run
one at a time in arrival order (a training client's requests arrive in their ``seq_id`` order: the SDK takes
turns before sending), jobs of different lanes run at once (different tenants' models share only the frozen
base weights, which training never writes), and a job without a lane (sampling: it folds adapters into the
shared base weights while it runs) runs alone, after everything queued before it and before anything queued
after it. A failed job fails only its future.

Batching: a job may belong to a `BatchGroup` (LoRA tenants' ``forward_backward`` on the shared base). The worker
that starts such a job also takes every other job of the group that may start now (the first pending job of a free
lane, queued before any job that runs alone) and runs them all with the group's ``run_batch``. When other lanes
submitted to the group recently, it waits up to the group's ``window_s`` for their next job, so tenants that step
in turn meet in one batch instead of racing past each other; a lone tenant never waits. With ``spread`` (CPU)
each batch takes only its share of the stepping lanes (their number over the workers), so every worker gets a
batch and the batches run at once. A job in a batch of one
runs its own ``run``; if ``run_batch`` raises, every job of the batch runs alone instead.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardforge.core.log import get_logger

__all__ = ["BatchGroup", "FutureQueue", "FutureResult", "UserError"]

_RECENT_S = 2.0
"""A lane counts as stepping in a group (worth waiting for) at most this long after its last submit there..."""
_MISSED_PERIODS = 3.0
"""... and no longer once it has missed this many of its own submit periods (the time between its last two submits
there): a client that stopped stops being waited for after a few of its steps, not after ``_RECENT_S``."""

log = get_logger(__name__)


class UserError(ValueError):
    """A request the client must fix (answered as a failed future with category ``user``)."""


@dataclass(kw_only=True, slots=True)
class FutureResult:
    """The answer to one queued request."""

    owner: str
    """The tenant that submitted it (only it may retrieve it)."""
    kind: str
    done: threading.Event = field(default_factory=threading.Event)
    json: dict[str, Any] | None = None
    """The result as JSON (pydantic-shaped responses)."""
    proto: bytes | None = None
    """The result as protobuf bytes (ForwardBackwardOutput, SampleResponse)."""
    error: str | None = None
    category: str = "user"
    queued_at: float = field(default_factory=time.perf_counter)
    batch_size: int = 1
    """How many jobs ran together with it (itself included)."""
    _callbacks: list[Callable[[], None]] = field(default_factory=list)
    _callbacks_lock: threading.Lock = field(default_factory=threading.Lock)

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the result is done: at once if it is, else from the thread that finishes it
        (an asyncio waiter passes ``loop.call_soon_threadsafe``: no thread has to block on `done`)."""
        with self._callbacks_lock:
            if not self.done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def finish(self) -> None:
        """Mark it done and run the waiting callbacks (an exception in one is logged, never raised)."""
        with self._callbacks_lock:
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.warning("a future's done callback failed:\n%s", traceback.format_exc())


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchGroup:
    """Jobs that may run as one batch (see the module doc)."""

    name: str
    run_batch: Callable[[list[Any]], list[Any]]
    """Items of the jobs -> per item its result (JSON dict or protobuf bytes) or the exception it failed with."""
    max_weight: int
    """The most total weight (tokens) in one batch; a job heavier than this still runs (alone)."""
    window_s: float = 0.0
    """How long a batch waits for the next job of lanes that recently submitted to the group."""
    spread: bool = False
    """Split the stepping lanes' jobs evenly over the workers (a batch per worker, e.g. per CPU core: batches on
    different threads run at once) instead of gathering them all into one batch (one device)."""


@dataclass(slots=True)
class _Job:
    result: FutureResult
    run: Callable[[], Any]
    lane: str | None
    group: BatchGroup | None = None
    item: Any = None
    weight: int = 0


class FutureQueue:
    """Queue jobs, run them on ``workers`` threads (lanes: see the module doc), keep their results until retrieved.

    Args:
        workers: worker threads (jobs of different lanes running at once).
        max_kept: results kept at most; the oldest retrieved ones are dropped first.
        on_done: called after each job with ``(result, seconds waited in the queue, seconds it ran)``
            (the service's metrics); an exception in it is logged, never raised.
    """

    def __init__(
        self,
        *,
        workers: int = 1,
        max_kept: int = 10000,
        on_done: Callable[[FutureResult, float, float], None] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self._on_done = on_done
        self._ids = itertools.count(1)
        self._results: dict[str, FutureResult] = {}
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._pending: list[_Job] = []
        self._busy_lanes: set[str] = set()
        self._running = 0
        self._exclusive = False
        self._closed = False
        self._gathering: set[str] = set()  # groups a worker is collecting a batch of
        self._recent: dict[str, dict[str, tuple[float, float]]] = {}  # group -> lane -> (last submit, its period)
        self._max_kept = max_kept
        self._workers = [
            threading.Thread(target=self._run, name=f"shardforge-serve-worker-{i}", daemon=True) for i in range(workers)
        ]
        for worker in self._workers:
            worker.start()

    def submit(
        self,
        owner: str,
        kind: str,
        job: Callable[[], Any],
        *,
        lane: str | None = None,
        group: BatchGroup | None = None,
        item: Any = None,
        weight: int = 0,
    ) -> str:
        """Queue ``job`` (returns a JSON dict or protobuf bytes) in ``lane`` (None: runs alone); its request id.

        With ``group`` (needs a lane) it may instead run with other jobs of the group: ``group.run_batch`` gets
        their ``item``s; ``weight`` counts against ``group.max_weight``."""
        if group is not None and lane is None:
            raise ValueError("a batched job needs a lane")
        request_id = f"req-{next(self._ids)}"
        result = FutureResult(owner=owner, kind=kind)
        with self._ready:
            self._results[request_id] = result
            self._evict()
            self._pending.append(_Job(result, job, lane, group, item, weight))
            if group is not None and lane is not None:
                lanes, now = self._recent.setdefault(group.name, {}), time.monotonic()
                last = lanes.get(lane)
                lanes[lane] = (now, now - last[0] if last is not None else _RECENT_S)
            self._ready.notify_all()
        return request_id

    def get(self, owner: str, request_id: str, wait_s: float) -> FutureResult | None:
        """The result of ``request_id`` once done, waiting up to ``wait_s``; None while pending.

        KeyError when no such request belongs to ``owner`` (another tenant's ids read as unknown)."""
        result = self.lookup(owner, request_id)
        return result if result.done.wait(wait_s) else None

    def lookup(self, owner: str, request_id: str) -> FutureResult:
        """The result record of ``request_id``, done or not (KeyError as in `get`)."""
        with self._lock:
            result = self._results.get(request_id)
        if result is None or result.owner != owner:
            raise KeyError(request_id)
        return result

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def depth(self) -> int:
        """Jobs queued and not started."""
        return len(self._pending)

    def _evict(self) -> None:
        if len(self._results) <= self._max_kept:
            return
        done = [rid for rid, r in self._results.items() if r.done.is_set()]
        for rid in done[: len(self._results) - self._max_kept]:
            del self._results[rid]

    def _next_job(self) -> _Job | None:
        """The first pending job that may start now (call with the lock held)."""
        if self._exclusive:
            return None
        seen: set[str] = set()
        for index, job in enumerate(self._pending):
            if job.lane is None:  # runs alone, after all before it: nothing after it may pass it
                return self._pending.pop(index) if index == 0 and self._running == 0 else None
            gathered = job.group is not None and job.group.name in self._gathering  # that worker will take it
            if job.lane not in self._busy_lanes and job.lane not in seen and not gathered:
                return self._pending.pop(index)
            seen.add(job.lane)
        return None

    def _collect(self, group: BatchGroup, weight: int, limit: int) -> list[_Job]:
        """Take up to ``limit`` pending jobs of ``group`` that may start now, while their weight fits (lock held)."""
        taken: list[_Job] = []
        seen: set[str] = set()
        for job in self._pending:
            if job.lane is None or len(taken) >= limit:  # nothing queued after a job that runs alone may pass it
                break
            if job.group is group and job.lane not in self._busy_lanes and job.lane not in seen:
                if weight + job.weight <= group.max_weight:
                    taken.append(job)
                    weight += job.weight
                    self._busy_lanes.add(job.lane)
            seen.add(job.lane)
        for job in taken:
            self._pending.remove(job)
        return taken

    def _gather(self, first: _Job, group: BatchGroup) -> list[_Job]:
        """``first`` and the jobs of its group that join it, waiting up to the group's window (lock held)."""
        jobs = [first]
        now = time.monotonic()
        recent = self._recent.get(group.name, {})
        stepping = sum(1 for last, period in recent.values() if now - last < min(_RECENT_S, _MISSED_PERIODS * period))
        wanted = -(-stepping // len(self._workers)) if group.spread else stepping  # ceil: a share per worker
        deadline = now + group.window_s
        self._gathering.add(group.name)
        try:
            while True:
                jobs += self._collect(group, sum(job.weight for job in jobs), max(wanted, 1) - len(jobs))
                left = deadline - time.monotonic()
                if len(jobs) >= wanted or left <= 0 or self._closed:
                    return jobs
                self._ready.wait(left)
        finally:
            self._gathering.discard(group.name)

    def _take(self) -> list[_Job]:
        with self._ready:
            job = None
            while not self._closed and (job := self._next_job()) is None:
                self._ready.wait()
            if job is None:  # closed
                return []
            self._running += 1
            if job.lane is None:
                self._exclusive = True
                return [job]
            self._busy_lanes.add(job.lane)
            return [job] if job.group is None else self._gather(job, job.group)

    def _release(self, jobs: list[_Job]) -> None:
        with self._ready:
            self._running -= 1
            for job in jobs:
                if job.lane is None:
                    self._exclusive = False
                else:
                    self._busy_lanes.discard(job.lane)
            self._ready.notify_all()

    def _run(self) -> None:
        while jobs := self._take():
            try:
                if len(jobs) == 1:
                    self._execute(jobs[0].result, jobs[0].run)
                else:
                    self._execute_batch(jobs)
            finally:
                self._release(jobs)

    def _execute_batch(self, jobs: list[_Job]) -> None:
        group = jobs[0].group
        assert group is not None
        started = time.perf_counter()
        try:
            outcomes = group.run_batch([job.item for job in jobs])
            assert len(outcomes) == len(jobs), f"{group.name}: {len(outcomes)} outcomes for {len(jobs)} jobs"
        except Exception:  # nothing was written yet (run_batch's contract): each job runs alone instead
            log.warning("%s batch of %d failed; running its jobs alone:\n%s", group.name, len(jobs),
                        traceback.format_exc())  # fmt: skip
            for job in jobs:
                self._execute(job.result, job.run)
            return
        for job, outcome in zip(jobs, outcomes, strict=True):
            job.result.batch_size = len(jobs)
            self._execute(job.result, functools.partial(_unwrap, outcome), started=started)

    def _execute(self, result: FutureResult, job: Callable[[], Any], started: float | None = None) -> None:
        started = time.perf_counter() if started is None else started
        try:
            value = job()
            if isinstance(value, bytes):
                result.proto = value
            else:
                result.json = value
        except UserError as exc:
            result.error, result.category = str(exc), "user"
        except (ValueError, TypeError, KeyError) as exc:
            result.error, result.category = f"{type(exc).__name__}: {exc}", "user"
        except Exception as exc:  # a crashed request must not take the worker (other tenants) down
            log.error("%s request failed:\n%s", result.kind, traceback.format_exc())
            result.error, result.category = f"{type(exc).__name__}: {exc}", "server"
        finally:
            result.finish()
            self._report(result, started)

    def _report(self, result: FutureResult, started: float) -> None:
        if self._on_done is None:
            return
        try:
            self._on_done(result, started - result.queued_at, time.perf_counter() - started)
        except Exception:  # metrics must never fail a request
            log.warning("serve metrics: %s", traceback.format_exc())


def _unwrap(outcome: Any) -> Any:
    """A batch's outcome for one job: its value, or raise what it failed with."""
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
