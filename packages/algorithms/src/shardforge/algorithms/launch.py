"""Relaunch a `shardforge` command on N local ranks with torchrun, in this process.

torchrun's elastic agent runs here (not in a child process), so a SIGTERM or Ctrl-C sent to
the `shardforge` command reaches the agent, which forwards SIGTERM to every rank and waits for
them (the ranks stop at a step boundary and save a checkpoint, see `trainers.base`); nothing is
left running. A failed rank is reported in one line (rank 0 has already printed the error); the
agent's ChildFailedError block and logs appear only with ``--debug``.
"""

from __future__ import annotations

import logging
import os
import sys

from shardforge.algorithms.log import get_logger

__all__ = ["relaunch", "strip_nproc"]

log = get_logger(__name__)


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc-per-node N`` / ``--nproc-per-node=N``."""
    cleaned: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            cleaned.append(arg)
    return cleaned


def relaunch(nproc: int, argv: list[str], *, debug: bool = False) -> int:
    """Run ``python -m shardforge.algorithms.cli argv`` on ``nproc`` ranks; return the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not debug:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        logging.getLogger("torch.distributed.run").setLevel(logging.CRITICAL)
    args = parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", "shardforge.algorithms.cli", *strip_nproc(argv)]
    )
    try:
        run(args)
    except ChildFailedError as exc:
        if debug:
            raise
        rank, failure = min(exc.failures.items())
        if rank != 0 or failure.exitcode < 0:  # rank 0 prints its own error; anything else gets a line here
            sys.stderr.write(
                f"shardforge: rank {rank} exited with code {failure.exitcode}; rerun with --debug for every "
                "rank's traceback\n"
            )
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:
        log.warning("stopped by %s; every rank has exited", exc.sigval.name)
        return 128 + int(exc.sigval)
    return 0
