"""Reward functions run with a timeout, a concurrency limit and an error policy: never a hang.

`GuardedReward` wraps any ``fn(prompt, response, reference) -> float`` (sync or ``async def``). Each
call runs on a worker of a bounded thread pool (``max_concurrency``) and is waited for at most
``timeout_s`` seconds. A call that raises, returns a non-finite value or times out becomes ``0.0``
and is counted (``on_error: zero``, the default, as verl's and AReaL's reward managers log and go
on) or stops the step with an error naming the prompt and response (``on_error: raise``). Batches
(`score_many`, `score_outcomes`) are submitted at once, so a slow verifier (math-verify, a sandbox, an HTTP judge)
scores ``max_concurrency`` responses in parallel. Counts (`pop_stats`) become ``reward/*`` metrics.

A timed-out call cannot be killed inside a thread; it keeps its worker until it returns, so a
function that hangs forever eventually occupies every worker and every later call times out (zeros,
counted) rather than blocking training. Use a subprocess inside the function for code that can
hang for good (the built-in ``python`` tool does).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GuardedReward", "RewardConfig", "RewardError"]

logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function failed (raised, timed out or returned a non-finite value) under ``on_error: raise``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    """How reward functions run (the ``reward:`` key of the RL trainers and ``shardforge eval``)."""

    timeout_s: float | None = 30.0
    """Seconds one call may take (None = no limit); a late call counts as a failure."""
    max_concurrency: int = 8
    """Calls running at once (worker threads)."""
    on_error: Literal["zero", "raise"] = "zero"
    """zero: a failed call scores 0.0, is logged (first few) and counted in reward/failures|timeouts|nonfinite;
    raise: it stops the step with an error naming the prompt and response."""
    ray_workers: int = 0
    """Score in a pool of this many Ray actors (``--launcher ray`` only; `rollout.ray_reward`), each applying the
    settings above; 0: in the trainer process."""

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0 seconds (or null for no limit)")
        if self.max_concurrency < 1:
            raise ValueError(f"reward.max_concurrency={self.max_concurrency} must be >= 1")
        if self.ray_workers < 0:
            raise ValueError(f"reward.ray_workers={self.ray_workers} must be >= 0 (0: score in the trainer process)")


def _call(fn: Callable[..., Any], prompt: str, response: str, reference: str) -> float:
    value = fn(prompt, response, reference)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return float(value)


async def _awaited(value: Any) -> Any:
    return await value


class _DaemonPool:
    """A fixed pool of daemon worker threads: a call that never returns cannot block interpreter exit
    (``concurrent.futures.ThreadPoolExecutor`` joins its workers at exit)."""

    def __init__(self, workers: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[float], Callable[..., float], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller through the future
                future.set_exception(exc)

    def submit(self, fn: Callable[..., float], *args: Any) -> Future[float]:
        future: Future[float] = Future()
        self._tasks.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)


class GuardedReward:
    """``fn`` behind a timeout, a concurrency limit and an error policy; itself a reward function."""

    def __init__(self, fn: Callable[..., Any], config: RewardConfig | None = None, *, name: str | None = None) -> None:
        self.fn, self.config = fn, config or RewardConfig()
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._pool = _DaemonPool(self.config.max_concurrency, "reward")
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "failures": 0, "timeouts": 0, "nonfinite": 0}
        self._logged = 0

    def __call__(self, prompt: str, response: str, reference: str) -> float:
        return self.score_many([(prompt, response, reference)])[0]

    def score_many(self, items: Sequence[tuple[str, str, str]]) -> list[float]:
        """Rewards of ``(prompt, response, reference)`` items, computed concurrently, in order."""
        futures = [self._pool.submit(_call, self.fn, *item) for item in items]
        return [self._result(future, item) for future, item in zip(futures, items, strict=True)]

    def score_outcomes(self, items: Sequence[tuple[str, str, str]]) -> list[float | RewardError]:
        """As `score_many`, but an item that fails under ``on_error: raise`` gets its `RewardError` in its place
        (the other items are still scored and counted): one batch for many episodes, each failing on its own."""
        futures = [self._pool.submit(_call, self.fn, *item) for item in items]
        out: list[float | RewardError] = []
        for future, item in zip(futures, items, strict=True):
            try:
                out.append(self._result(future, item))
            except RewardError as error:
                out.append(error)
        return out

    def _result(self, future: Future[float], item: tuple[str, str, str]) -> float:
        prompt, response = item[0], item[1]
        kind, message = "", ""
        try:
            value = future.result(timeout=self.config.timeout_s)
            if not math.isfinite(value):
                kind = "nonfinite"
                message = (
                    f"the reward function returned {value} for prompt {prompt!r}, response {response!r}; "
                    "rewards must be finite numbers"
                )
        except FutureTimeout:
            future.cancel()
            kind = "timeouts"
            message = (
                f"the reward function timed out (reward.timeout_s={self.config.timeout_s}) on prompt {prompt!r}, "
                f"response {response!r}"
            )
        except Exception as exc:
            kind = "failures"
            message = f"the reward function raised on prompt {prompt!r}, response {response!r}: {exc!r}"
        with self._lock:
            self._counts["calls"] += 1
            if kind:
                self._counts[kind] += 1
        if not kind:
            return value
        if self.config.on_error == "raise":
            raise RewardError(f"{message} [{self.name}; reward.on_error=raise: set it to zero to score 0.0 and go on]")
        with self._lock:
            self._logged += 1
            first = self._logged <= 3
        if first:
            logger.warning("%s [%s]; scored 0.0 (counted in reward/%s)", message, self.name, kind)
        return 0.0

    def pop_stats(self) -> dict[str, float]:
        """``reward/calls``, ``reward/failures``, ``reward/timeouts``, ``reward/nonfinite`` since the last call."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        out = {f"reward/{k}": float(v) for k, v in counts.items()}
        inner = getattr(self.fn, "pop_stats", None)  # e.g. MathVerifier: unparseable / wrong / correct
        if callable(inner):
            out |= {f"reward/{k}": float(v) for k, v in inner().items()}
        return out

    def close(self) -> None:
        """Stop the workers (calls still running finish in the background)."""
        self._pool.shutdown()
