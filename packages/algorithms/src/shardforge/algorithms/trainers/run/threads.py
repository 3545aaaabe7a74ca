"""The torch thread count of a `shardforge train` process, chosen once at start-up and logged.

Ranks launched by ``--nproc-per-node N > 1`` (or torchrun) run one thread each
(``OMP_NUM_THREADS=1``): N processes already use N cores. A single process would get torch's
default, one thread per core, which oversubscribes a machine whose cores are busy with other
work: on a 2-core box with two other busy processes, two threads ran the demo SFT step
several times slower than one (``benchmarks/bench_threads.py``; numbers in
docs/packages/algorithms.md, "Threads"). So a single process takes the cores that are free
at start-up: ``cores - round(1-minute load average)``, at least 1. ``OMP_NUM_THREADS`` (or
``SHARDFORGE_THREADS``) set by the user always wins.
"""

from __future__ import annotations

import logging
import os

__all__ = ["default_threads", "set_process_threads"]

log = logging.getLogger(__name__)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def default_threads(cores: int, load: float | None) -> int:
    """Threads for one process on ``cores`` cores with 1-minute ``load`` (None: unknown -> all cores)."""
    if load is None:
        return max(1, cores)
    return max(1, min(cores, cores - int(load + 0.5)))


def set_process_threads(world_size: int) -> str:
    """Set torch's intra-op threads for this process (see the module) and log one line; return it."""
    import torch

    cores, env = _cores(), os.environ.get("SHARDFORGE_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if env:
        threads, why = (
            int(env),
            "from " + ("SHARDFORGE_THREADS" if os.environ.get("SHARDFORGE_THREADS") else "OMP_NUM_THREADS"),
        )
    elif world_size > 1:
        threads, why = 1, f"{world_size} processes on this machine"
    else:
        load = _load()
        threads = default_threads(cores, load)
        why = f"{cores} cores, 1-min load {load:.1f}" if load is not None else f"{cores} cores"
    torch.set_num_threads(threads)
    line = f"torch threads: {torch.get_num_threads()} ({why}; set OMP_NUM_THREADS to choose)"
    log.info(line)
    return line
