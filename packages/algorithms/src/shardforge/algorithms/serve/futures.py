"""The service's futures: every model-touching request is queued and answered later through
``/api/v1/retrieve_future``, as the Tinker SDK expects (it polls until the answer is not ``try_again``).

One worker thread runs the queued work in arrival order: requests of one training client arrive in
their ``seq_id`` order (the SDK takes turns before sending), and a single worker keeps the model, its
optimizers and the sampling engine free of concurrent mutation. A failed job fails only its future.
"""

from __future__ import annotations

import itertools
import queue
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


class FutureQueue:
    """Queue jobs, run them on one worker thread, keep their results until retrieved.

    Args:
        max_kept: results kept at most; the oldest retrieved ones are dropped first.
        on_done: called after each job with ``(result, seconds waited in the queue, seconds it ran)``
            (the service's metrics); an exception in it is logged, never raised.
    """

    def __init__(
        self, *, max_kept: int = 10000, on_done: Callable[[FutureResult, float, float], None] | None = None
    ) -> None:
        self._on_done = on_done
        self._ids = itertools.count(1)
        self._results: dict[str, FutureResult] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue[tuple[FutureResult, Callable[[], Any]] | None] = queue.Queue()
        self._max_kept = max_kept
        self._worker = threading.Thread(target=self._run, name="shardforge-serve-worker", daemon=True)
        self._worker.start()

    def submit(self, owner: str, kind: str, job: Callable[[], Any]) -> str:
        """Queue ``job`` (returns a JSON dict or protobuf bytes); return its request id."""
        request_id = f"req-{next(self._ids)}"
        result = FutureResult(owner=owner, kind=kind)
        with self._lock:
            self._results[request_id] = result
            self._evict()
        self._jobs.put((result, job))
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
        self._jobs.put(None)

    def depth(self) -> int:
        """Jobs queued and not started."""
        return self._jobs.qsize()

    def _evict(self) -> None:
        if len(self._results) <= self._max_kept:
            return
        done = [rid for rid, r in self._results.items() if r.done.is_set()]
        for rid in done[: len(self._results) - self._max_kept]:
            del self._results[rid]

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            result, job = item
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
