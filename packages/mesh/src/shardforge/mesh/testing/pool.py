"""A reusable pool of N local ranks with an initialised (gloo) process group.

Spawning Python + torch costs seconds per process, so tests share one pool per world
size: `get_rank_pool(4).run(fn, *args)` runs ``fn`` on all four ranks and returns the
per-rank results (or raises `RankFailure` with every rank's traceback). Functions are
sent with cloudpickle, by value when their module (a test file) is not importable by
name in the workers.

If a rank fails while the others wait in a collective, the pool waits ``grace_s`` for
the rest, then kills and lazily restarts all workers: one broken test never hangs or
poisons the next one.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

from shardforge.mesh.distributed import free_port

__all__ = ["RankFailure", "RankPool", "get_rank_pool", "run_on_ranks"]


_START_TRIES = 3
"""Starts of a pool on fresh ports before its port being taken is an error."""
_PORT_TAKEN = "EADDRINUSE"
"""In rank 0's error when the pool's port was taken before its store bound it."""


class RankFailure(RuntimeError):
    """One or more ranks raised (or died, or timed out) while running a function."""

    def __init__(self, fn_name: str, errors: dict[int, str]) -> None:
        self.errors = errors
        parts = [f"{fn_name} failed on rank(s) {sorted(errors)}:"]
        for rank in sorted(errors):
            parts.append(f"--- rank {rank} ---\n{errors[rank].rstrip()}")
        super().__init__("\n".join(parts))


class RankPool:
    """``world_size`` worker processes, each rank of one default process group."""

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        grace_s: float = 5.0,
        num_threads: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        # Default: the test process's own OMP_NUM_THREADS (1 if unset), so `SHARDFORGE_TEST_THREADS=2 nox -s
        # tests` also changes the ranks' reduction order, not only the single-process references'.
        self.num_threads = num_threads if num_threads is not None else int(os.environ.get("OMP_NUM_THREADS", "1"))
        self.env = dict(env or {})
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._task_queues: list[Any] = []
        self._result_queue: Any = None
        self._task_ids = itertools.count()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Spawn the workers and wait until every rank has joined the process group.

        The port is picked free in this process and bound by rank 0 seconds later (after the spawn): another
        process (a parallel test worker, or any client connection taking an ephemeral port) may take it in
        between. Rank 0 then fails with EADDRINUSE, and the pool starts again on a new port (up to 3 tries)."""
        for attempt in range(_START_TRIES):
            try:
                self._start_once()
                return
            except RankFailure as failure:
                if attempt == _START_TRIES - 1 or not any(_PORT_TAKEN in e for e in failure.errors.values()):
                    raise

    def _start_once(self) -> None:
        if self._procs:
            return
        port = free_port()
        self._result_queue = self._ctx.Queue()
        self._task_queues = [self._ctx.Queue() for _ in range(self.world_size)]
        for rank in range(self.world_size):
            proc = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self.backend, self.timeout_s, self.num_threads, self.env),
                kwargs={"task_queue": self._task_queues[rank], "result_queue": self._result_queue},
                daemon=True,
                name=f"shardforge-rank{rank}",
            )
            proc.start()
            self._procs.append(proc)
        ready: set[int] = set()
        errors: dict[int, str] = {}
        deadline = time.monotonic() + max(self.timeout_s, 60.0)
        while len(ready) + len(errors) < self.world_size:
            item = self._get(deadline)
            if item is None:
                break
            rank, task_id, ok, payload = item
            if task_id != -1:
                continue
            if ok:
                ready.add(rank)
            else:
                errors[rank] = payload
                if _PORT_TAKEN in payload:  # the others wait for a store that never listens: start again now
                    break
        missing = set(range(self.world_size)) - ready - set(errors)
        for rank in missing:
            errors[rank] = "did not start (timed out or died)"
        if errors:
            self.close()
            raise RankFailure("RankPool.start", errors)

    def close(self) -> None:
        """Stop all workers (politely, then by force)."""
        for q in self._task_queues:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        self._procs = []
        self._task_queues = []
        self._result_queue = None

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ running
    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float | None = None,
        grace_s: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank.

        After the first rank fails, the others get ``grace_s`` (default: the pool's) to report their
        own result or error; a test that expects every rank to raise its own error raises it."""
        import cloudpickle

        self.start()
        _register_by_value(fn)
        payload = cloudpickle.dumps((fn, args, kwargs))
        task_id = next(self._task_ids)
        for q in self._task_queues:
            q.put((task_id, payload))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while len(results) + len(errors) < self.world_size:
            limit = deadline if not errors else min(deadline, time.monotonic() + (grace_s or self.grace_s))
            item = self._get(limit)
            if item is None:
                break
            rank, got_id, ok, data = item
            if got_id != task_id:
                continue
            if ok:
                results[rank] = cloudpickle.loads(data)
            else:
                errors[rank] = data
        if errors or len(results) < self.world_size:
            for rank in range(self.world_size):
                if rank not in results and rank not in errors:
                    errors[rank] = "no result: blocked in a collective after another rank failed, died, or timed out"
            self.close()  # a rank may be stuck in a collective: restart cleanly next time
            raise RankFailure(getattr(fn, "__qualname__", repr(fn)), errors)
        return [results[r] for r in range(self.world_size)]

    def _get(self, deadline: float) -> tuple[int, int, bool, Any] | None:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                item: tuple[int, int, bool, Any] = self._result_queue.get(timeout=min(remaining, 1.0))
                return item
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    # Drain what the living ranks may still send, then report.
                    try:
                        return self._result_queue.get(timeout=0.5)  # type: ignore[no-any-return]
                    except queue.Empty:
                        return None


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    num_threads: int,
    env: dict[str, str],
    *,
    task_queue: Any,
    result_queue: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    import cloudpickle
    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except BaseException:
        result_queue.put((rank, -1, False, traceback.format_exc()))
        return
    result_queue.put((rank, -1, True, None))
    while True:
        message = task_queue.get()
        if message is None:
            break
        task_id, payload = message
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            out = fn(*args, **kwargs)
            result_queue.put((rank, task_id, True, cloudpickle.dumps(out)))
        except BaseException:
            result_queue.put((rank, task_id, False, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


# ---------------------------------------------------------------------- registry
_POOLS: dict[tuple[int, str], RankPool] = {}


def get_rank_pool(world_size: int, *, backend: str = "gloo") -> RankPool:
    """A process-wide shared pool for ``world_size`` (started on first use, closed at exit)."""
    key = (world_size, backend)
    if key not in _POOLS:
        _POOLS[key] = RankPool(world_size, backend=backend)
    return _POOLS[key]


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn`` on ``world_size`` fresh gloo ranks (a throwaway pool); return per-rank results."""
    with RankPool(world_size) as pool:
        return pool.run(fn, *args, **kwargs)


# ---------------------------------------------------------------------- helpers
def _register_by_value(fn: Callable[..., Any]) -> None:
    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if module is None or module.__name__ == "__main__":
        return
    if not _importable_by_name(module):
        cloudpickle.register_pickle_by_value(module)


def _importable_by_name(module: ModuleType) -> bool:
    """True when a fresh interpreter with our sys.path would import ``module`` from the same file."""
    file = getattr(module, "__file__", None)
    if file is None:
        return True
    file = os.path.abspath(file)
    parts = module.__name__.split(".")
    for entry in sys.path:
        base = os.path.abspath(entry or os.getcwd())
        candidate = os.path.join(base, *parts)
        if file in (candidate + ".py", os.path.join(candidate, "__init__.py")):
            return True
    return False
