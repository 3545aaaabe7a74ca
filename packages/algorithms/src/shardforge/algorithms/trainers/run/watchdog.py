"""Hang diagnosis: a stuck step writes every thread's Python stack; a collective timeout is one line.

Per rank, `StepWatchdog.arm` starts faulthandler's watchdog before each step
(`faulthandler.dump_traceback_later`, a C thread: it fires even while the main thread is stuck in C
code or holds the GIL). If the step is still running ``after_s`` seconds later, every thread's stack is
appended to ``output_dir/logs/stacks-rank{R}.txt`` under a header line naming the rank and the step.
The default ``after_s`` is 0.9 x ``engine.dist_timeout_s``: a rank that never reaches a collective has
written its stack before its peers' collective times out. Fatal signals (e.g. SIGABRT from NCCL's own
timeout watchdog) also dump into that file (`faulthandler.enable`).

When a collective times out on a rank (gloo raises), `collective_timeout_error` turns the backend's
message into a `TimeoutError` that names this rank, the step and the timeout, and, from the dumps
other ranks wrote to the same directory, the ranks that were *not* inside ``torch.distributed`` (the
stuck ones) with their innermost frame. Files from ranks on other nodes are seen when output_dir is on
shared storage. How to read them: docs/multinode.md, "When a run hangs".
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "StackDump",
    "StepWatchdog",
    "collective_timeout_error",
    "failed_peer",
    "is_collective_timeout",
    "read_stack_dumps",
]

log = logging.getLogger(__name__)

_HEADER = "# shardforge stack dump"
_HEADER_RE = re.compile(rf"^{_HEADER}: rank (\d+) (\w+) (\d+) main_thread (0x[0-9a-f]+) after_s (\S+)")
_THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)')
# Backend messages of a timed-out collective: gloo ("Timed out waiting 4000ms for recv operation"),
# NCCL when it raises instead of aborting ("Watchdog caught collective operation timeout"), the store.
_TIMEOUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)


class StepWatchdog:
    """One rank's per-step stack-dump timer (a no-op with ``after_s <= 0``)."""

    def __init__(self, directory: str | Path, rank: int, after_s: float) -> None:
        self.path = Path(directory) / f"stacks-rank{rank}.txt"
        self.rank, self.after_s = rank, after_s
        self.what, self.step = "step", 0
        self._fd: int | None = None
        self._header_len = 0
        self._armed_at: float | None = None
        self._owns_fatal = False
        self._created = time.time()

    def arm(self, step: int, what: str = "step") -> None:
        """Start the timer for ``what`` number ``step`` (1-based); the previous one is disarmed first."""
        if self.after_s <= 0:
            return
        self.disarm()
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            if not faulthandler.is_enabled():  # keep a user's own `python -X faulthandler`
                faulthandler.enable(file=self._fd, all_threads=True)
                self._owns_fatal = True
        self.what, self.step = what, step
        main = threading.main_thread().ident or 0
        header = (
            f"{_HEADER}: rank {self.rank} {what} {step} main_thread 0x{main:016x} after_s {self.after_s:g} "
            f"started {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
        ).encode()
        os.ftruncate(self._fd, 0)  # one file per rank, rewritten per step: no file is created per step
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, header)
        self._header_len = len(header)
        self._armed_at = time.monotonic()
        faulthandler.dump_traceback_later(self.after_s, repeat=False, file=self._fd, exit=False)

    def fired(self) -> bool:
        """Whether the current step's stacks were written (the file grew past its header)."""
        return self._fd is not None and os.fstat(self._fd).st_size > self._header_len

    def teardown_reason(self) -> str | None:
        """Why a SIGTERM now means "exit at once" rather than "stop at the step boundary": a peer rank
        under the same launcher already failed (so the collective at the boundary cannot complete; the
        agent is tearing the ranks down and would SIGKILL this one after its grace period)."""
        peer = failed_peer(self.rank, since=self._created)
        if peer is None:
            return None
        where = f", in {self.what} {self.step}" if self._armed_at is not None else ""
        return f"rank {peer} had failed{where}"

    def disarm(self) -> None:
        """Stop the timer; a step that ran past ``after_s`` but finished keeps its stacks in ``-slow.txt``."""
        if self._armed_at is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self._armed_at = None
        if self.fired():
            slow = self.path.with_name(f"stacks-rank{self.rank}-slow.txt")
            shutil.copyfile(self.path, slow)
            log.warning(
                "rank %d: %s %d ran longer than %g s; its stacks at that moment are in %s",
                self.rank,
                self.what,
                self.step,
                self.after_s,
                slow,
            )

    def close(self) -> None:
        """Stop the timer; remove the file unless it holds a dump (the run ends with the failing step's file)."""
        if self._fd is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self._armed_at = None
        if self._owns_fatal:
            faulthandler.disable()
            self._owns_fatal = False
        keep = self.fired()
        os.close(self._fd)
        self._fd = None
        if not keep:
            self.path.unlink(missing_ok=True)


def failed_peer(rank: int, since: float) -> int | None:
    """A rank other than ``rank`` that reported an error to this node's `shardforge` launcher after
    ``since`` (``SHARDFORGE_ERROR_DIR``, written by `shardforge.algorithms.launch.torchrun.write_rank_error`)."""
    directory = os.environ.get("SHARDFORGE_ERROR_DIR")
    if not directory:
        return None
    for path in Path(directory).glob("rank-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if int(record.get("rank", rank)) != rank and float(record.get("time", 0.0)) >= since:
            return int(record["rank"])
    return None


@dataclass(frozen=True, slots=True)
class StackDump:
    """What one rank's stacks file says."""

    rank: int
    what: str
    step: int
    path: Path
    fired: bool
    """False: the rank was in this step but had not run ``after_s`` yet (or died before)."""
    frame: str | None
    """The main thread's innermost Python frame, ``func (file:line)``."""
    in_collective: bool
    """The innermost frame is inside torch.distributed (the rank waits for its peers)."""


def read_stack_dumps(directory: str | Path) -> list[StackDump]:
    """Every ``stacks-rank{R}.txt`` in ``directory`` (the in-flight step of each rank), by rank."""
    dumps = []
    for path in sorted(Path(directory).glob("stacks-rank*.txt")):
        if path.name.endswith("-slow.txt"):
            continue
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        match = _HEADER_RE.match(lines[0]) if lines else None
        if match is None:
            continue
        rank, what, step, main = int(match[1]), match[2], int(match[3]), int(match[4], 16)
        frame_line = _innermost_frame(lines[1:], main)
        frame, in_collective = None, False
        if frame_line is not None:
            file, line, func = frame_line
            frame = f"{func} ({Path(file).name}:{line})"
            in_collective = "torch/distributed/" in file.replace(os.sep, "/")
        dumps.append(StackDump(rank, what, step, path, len(lines) > 1, frame, in_collective))
    return sorted(dumps, key=lambda d: d.rank)


def _innermost_frame(lines: list[str], main_thread: int) -> tuple[str, str, str] | None:
    """The first frame of ``main_thread``'s block (faulthandler lists the most recent call first)."""
    in_main = False
    for line in lines:
        thread = _THREAD_RE.match(line)
        if thread:
            in_main = int(thread[1], 16) == main_thread
            continue
        frame = _FRAME_RE.match(line)
        if in_main and frame:
            return frame[1], frame[2], frame[3]
    return None


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a timed-out collective (a backend RuntimeError whose message says so)."""
    return isinstance(exc, RuntimeError) and bool(_TIMEOUT_RE.search(str(exc)))


def collective_timeout_error(
    exc: BaseException, watchdog: StepWatchdog, timeout_s: float, wait_s: float = 3.0
) -> TimeoutError:
    """The one-line error for a timed-out collective on this rank, naming the stuck ranks it can see.

    Waits up to ``wait_s`` for the other ranks' dumps (they fire at ``after_s`` < ``timeout_s`` after
    their own step start, so they are normally there already)."""
    directory = watchdog.path.parent
    deadline = time.monotonic() + wait_s
    dumps = read_stack_dumps(directory)
    while time.monotonic() < deadline and not any(d.fired and d.rank != watchdog.rank for d in dumps):
        time.sleep(0.2)
        dumps = read_stack_dumps(directory)
    stuck = [d for d in dumps if d.fired and not d.in_collective and d.rank != watchdog.rank]
    if stuck:
        where = "; ".join(f"rank {d.rank} in {d.what} {d.step} at {d.frame}" for d in stuck)
        culprit = f"ranks not inside a collective after {watchdog.after_s:g} s: {where}"
    elif any(d.fired and d.rank != watchdog.rank for d in dumps):
        culprit = "every rank that wrote a dump was inside a collective (mismatched collectives across ranks?)"
    else:
        culprit = "no other rank's dump is in this directory (ranks on other nodes write to their own output_dir/logs)"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return TimeoutError(
        f"rank {watchdog.rank}: a collective timed out after {timeout_s:g} s (engine.dist_timeout_s) in "
        f"{watchdog.what} {watchdog.step}; {culprit}; every rank's Python stacks: {directory}/stacks-rank*.txt "
        f"(docs/multinode.md, 'When a run hangs'); backend: {first_line[:200]}"
    )
