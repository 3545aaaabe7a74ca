"""Relaunch a `shardforge` command on N local ranks with torchrun, in this process.

torchrun's elastic agent runs here (not in a child process), so a SIGTERM or Ctrl-C sent to
the `shardforge` command reaches the agent, which forwards SIGTERM to every rank and waits for
them (the ranks stop at a step boundary and save a checkpoint, see `trainers.base`); nothing is
left running. A failed run is reported in one line: each failing rank writes its error line to a
file in a directory this process owns (``SHARDFORGE_ERROR_DIR``), and the earliest one is printed
(the first failure is the cause; the agent then stops the other ranks, rank 0 included, which is
why rank 0 cannot print it itself). The agent's ChildFailedError block and logs appear only with
``--debug``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from shardforge.algorithms.launch.multinode import LaunchSpec, strip_launch_args
from shardforge.core.log import get_logger

__all__ = ["die_with_launcher", "relaunch", "write_rank_error"]

ERROR_DIR_ENV = "SHARDFORGE_ERROR_DIR"
# The launching process's PID, inherited by the ranks it starts (die_with_launcher checks it).
LAUNCHER_PID_ENV = "SHARDFORGE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

log = get_logger(__name__)


def write_rank_error(line: str) -> bool:
    """Hand this rank's error line to the launching `shardforge` process; False if none is listening."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return False
    rank = os.environ.get("RANK", "0")
    record = {"rank": int(rank), "time": time.time(), "line": line}
    tmp = Path(directory) / f".rank-{rank}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(Path(directory) / f"rank-{rank}.json")  # atomic: the launcher never reads half a record
    return True


def die_with_launcher() -> bool:
    """Have the kernel SIGKILL this rank when the process that started it dies, however it dies.

    torchrun's agent forwards SIGTERM/SIGINT to the ranks, but nothing is forwarded when the agent
    itself is killed with SIGKILL (or crashes): the ranks would go on training and writing into the
    output directory, next to any run started after it. ``PR_SET_PDEATHSIG`` (Linux) closes that gap.
    Only for ranks started by a torchrun agent (ours or the user's); returns whether it is armed.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if not sys.platform.startswith("linux"):
        watch_parent(os.getppid())
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning("could not arm the parent-death signal (errno %d): a thread watches the parent", ctypes.get_errno())
        watch_parent(os.getppid())
        return False
    expected = os.environ.get(LAUNCHER_PID_ENV)
    # The launcher may have died before the signal was armed: then this rank is already orphaned.
    if expected is not None and os.getppid() != int(expected):
        os._exit(1)
    return True


def watch_parent(parent: int, interval_s: float = 1.0) -> None:
    """The fallback where ``PR_SET_PDEATHSIG`` is missing: a daemon thread that ends this process (exit code
    1, no cleanup: the launcher that owned the run is gone) within ``interval_s`` of its parent ``parent``
    going away (this process reparented)."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="shardforge-parent-watch", daemon=True).start()


def first_rank_error(directory: str | Path) -> str | None:
    """The error line of the rank that failed first (by wall time, then rank), if any wrote one."""
    records = []
    for path in Path(directory).glob("rank-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return None
    first = min(records, key=lambda r: (r["time"], r["rank"]))
    return str(first["line"])


def relaunch(spec: LaunchSpec, argv: list[str], *, debug: bool = False) -> int:
    """Run ``python -m shardforge.algorithms.cli argv`` on this node's ranks of ``spec``; return the exit code.

    Across nodes each node's agent prints the first error of its own ranks (a rank that failed
    because a peer on another node died says so: look for the first error among the nodes).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    from shardforge.algorithms.trainers.run.startup_gc import end_startup_gc

    end_startup_gc()  # imported: the agent now waits for the ranks as long as the run lasts

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if spec.max_restarts > 0:
        # By default the agents share their rendezvous TCPStore with the ranks, and it outlives a restart:
        # the restarted ranks then read the dead ranks' gloo/NCCL addresses from it ("Connection refused").
        # torch's opt-out gives every restart round a fresh store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if not debug:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        logging.getLogger("torch.distributed.run").setLevel(logging.CRITICAL)
    args = parse_args([*spec.torchrun_args(), "-m", "shardforge.algorithms.cli", *strip_launch_args(argv)])
    with tempfile.TemporaryDirectory(prefix="shardforge-errors-") as error_dir:
        os.environ[ERROR_DIR_ENV] = error_dir  # inherited by every rank
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks die with this process (die_with_launcher)
        try:
            run(args)
        except ChildFailedError as exc:
            if debug:
                raise
            line = first_rank_error(error_dir)
            # no rank wrote a line (a crash, a kill): name the rank that failed first. An exit code first, then a
            # signal other than SIGTERM: the agent stops the surviving ranks with SIGTERM once one fails, so a rank
            # that ended on SIGTERM is rarely the cause (e.g. rank 1 killed with -9, rank 0 then stopped: -15).
            rank, failure = min(
                exc.failures.items(),
                key=lambda item: (item[1].exitcode < 0, item[1].exitcode == -signal.SIGTERM, item[0]),
            )
            if line is None:
                line = (
                    f"shardforge: rank {rank} exited with code {failure.exitcode}; rerun with --debug for "
                    "every rank's traceback\n"
                )
            sys.stderr.write(line)
            return failure.exitcode if failure.exitcode > 0 else 1
        except RendezvousError as exc:
            if debug:
                raise
            sys.stderr.write(
                f"shardforge: error: rendezvous at {spec.rdzv_endpoint} (id {spec.rdzv_id!r}, {spec.nnodes} nodes) "
                f"failed: {type(exc).__name__}: {exc}; check that every node runs the same --nnodes/--rdzv-endpoint/"
                "--rdzv-id, that the endpoint host:port is reachable from every node (firewall), see docs/multinode.md\n"
            )
            return 1
        except SignalException as exc:
            log.warning("stopped by %s; every rank has exited", exc.sigval.name)
            return 128 + int(exc.sigval)
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
            os.environ.pop(LAUNCHER_PID_ENV, None)
    return 0
