"""The service's futures: every model-touching request is queued and answered later through
``/api/v1/retrieve_future``, as the Tinker SDK expects (it polls until the answer is not ``try_again``).

``workers`` threads run the queued work. A job has a lane (a training model's id) or none: jobs of one lane run
one at a time in arrival order (a training client's requests arrive in their ``seq_id`` order: the SDK takes
turns before sending), jobs of different lanes run at once (different tenants' models share only the frozen
base weights, which training never writes), and a job without a lane (sampling: it folds adapters into the
shared base weights while it runs) runs alone, after everything queued before it and before anything queued
after it. A failed job fails only its future.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardforge.core.log import get_logger

__all__ = ["FutureQueue", "FutureResult", "UserError"]

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


@dataclass(slots=True)
class _Job:
    result: FutureResult
    run: Callable[[], Any]
    lane: str | None


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
        self._max_kept = max_kept
        self._workers = [
            threading.Thread(target=self._run, name=f"shardforge-serve-worker-{i}", daemon=True) for i in range(workers)
        ]
        for worker in self._workers:
            worker.start()

    def submit(self, owner: str, kind: str, job: Callable[[], Any], *, lane: str | None = None) -> str:
        """Queue ``job`` (returns a JSON dict or protobuf bytes) in ``lane`` (None: runs alone); its request id."""
        request_id = f"req-{next(self._ids)}"
        result = FutureResult(owner=owner, kind=kind)
        with self._ready:
            self._results[request_id] = result
            self._evict()
            self._pending.append(_Job(result, job, lane))
            self._ready.notify_all()
        return request_id

    def get(self, owner: str, request_id: str, wait_s: float) -> FutureResult | None:
        """The result of ``request_id`` once done, waiting up to ``wait_s``; None while pending.

        KeyError when no such request belongs to ``owner`` (another tenant's ids read as unknown)."""
        with self._lock:
            result = self._results.get(request_id)
        if result is None or result.owner != owner:
            raise KeyError(request_id)
        return result if result.done.wait(wait_s) else None

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
            if job.lane not in self._busy_lanes and job.lane not in seen:
                return self._pending.pop(index)
            seen.add(job.lane)
        return None

    def _take(self) -> _Job | None:
        with self._ready:
            job = None
            while not self._closed and (job := self._next_job()) is None:
                self._ready.wait()
            if job is None:  # closed
                return None
            self._running += 1
            if job.lane is None:
                self._exclusive = True
            else:
                self._busy_lanes.add(job.lane)
            return job

    def _release(self, job: _Job) -> None:
        with self._ready:
            self._running -= 1
            if job.lane is None:
                self._exclusive = False
            else:
                self._busy_lanes.discard(job.lane)
            self._ready.notify_all()

    def _run(self) -> None:
        while (job := self._take()) is not None:
            try:
                self._execute(job.result, job.run)
            finally:
                self._release(job)

    def _execute(self, result: FutureResult, job: Callable[[], Any]) -> None:
        started = time.perf_counter()
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
            result.done.set()
            self._report(result, started)

    def _report(self, result: FutureResult, started: float) -> None:
        if self._on_done is None:
            return
        try:
            self._on_done(result, started - result.queued_at, time.perf_counter() - started)
        except Exception:  # metrics must never fail a request
            log.warning("serve metrics: %s", traceback.format_exc())
