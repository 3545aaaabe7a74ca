"""One run per output directory: ``output_dir/.shardforge.lock``.

The process that starts a run (the launching ``shardforge`` command, node 0's launcher across nodes,
or global rank 0 under an external torchrun) creates the lock before any rank writes to the folder and
removes it when the run ends. A second run on a folder whose lock names a live process fails in one
line naming that process (PID, host, command). A lock left by a run that died without cleaning up
(``kill -9``, a power cut) is taken over with a warning: on the same host the PID is checked (and its
start time, so a recycled PID does not count as the old run); a lock written on another host cannot be
checked from here and is refused with the way out (delete the file when that run is gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardforge.core.log import get_logger

__all__ = ["LOCK_HELD_ENV", "LOCK_NAME", "OutputDirLock", "OutputDirLocked", "run_lock"]

LOCK_NAME = ".shardforge.lock"
# Set by the process holding the lock: the ranks it launches (which inherit it) do not lock again.
LOCK_HELD_ENV = "SHARDFORGE_OUTPUT_LOCK"

log = get_logger(__name__)


class OutputDirLocked(RuntimeError):
    """Another live run holds the output directory."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name (field 2) may hold spaces


def _alive(pid: int, start_time: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    if start_time is None:
        return True
    now = _start_time(pid)
    return now is None or now == start_time


class OutputDirLock:
    """Hold ``directory``'s run lock; ``with OutputDirLock(dir):`` or ``acquire()`` / ``release()``."""

    def __init__(self, directory: str | Path, command: str | None = None) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.command = command if command is not None else " ".join(sys.argv)
        self.held = False
        self.created = False

    def _record(self) -> dict[str, Any]:
        pid = os.getpid()
        return {
            "pid": pid,
            "host": socket.gethostname(),
            "start_time": _start_time(pid),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": self.command,
        }

    def _read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # half-written or damaged: treated as stale below
        return data if isinstance(data, dict) else {}

    def _holder_is_live(self, holder: dict[str, Any]) -> bool:
        if holder.get("host") != socket.gethostname():
            return bool(holder)  # another host's run cannot be checked from here: assume it lives
        pid = holder.get("pid")
        return isinstance(pid, int) and _alive(pid, holder.get("start_time"))

    def acquire(self) -> OutputDirLock:
        self.created = not self.directory.exists()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(
                f"output_dir {str(self.directory)!r} cannot be created ({exc}); choose another output_dir"
            ) from exc
        record = json.dumps(self._record(), indent=1)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue  # released between our two calls: try again
                if self._holder_is_live(holder):
                    raise OutputDirLocked(self._refusal(holder)) from None
                log.warning(
                    "taking over the lock of %s: its run (PID %s on %s, since %s) is gone",
                    self.directory,
                    holder.get("pid", "?"),
                    holder.get("host", "?"),
                    holder.get("since", "?"),
                )
                tmp = self.path.with_name(f"{LOCK_NAME}.{os.getpid()}.tmp")
                tmp.write_text(record)
                tmp.replace(self.path)  # atomic; a racing taker would also see the old run gone
                self.held = True
                return self
            with os.fdopen(fd, "w") as handle:
                handle.write(record)
            self.held = True
            return self
        raise OutputDirLocked(f"could not lock {self.directory}: its lock file keeps changing ({self.path})")

    def _refusal(self, holder: dict[str, Any]) -> str:
        where = f"PID {holder.get('pid', '?')} on {holder.get('host', '?')}"
        other_host = holder.get("host") != socket.gethostname()
        gone = (
            f"if that run is gone (it ran on another host, which cannot be checked from here), delete {self.path}"
            if other_host
            else f"stop it (kill {holder.get('pid', '?')})"
        )
        return (
            f"output_dir {str(self.directory)!r} is in use by a live run ({where}, since {holder.get('since', '?')}: "
            f"{holder.get('command', '?')}); two runs in one folder overwrite each other's checkpoints and metrics. "
            f"Wait for it, {gone}, or choose another output_dir"
        )

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
            if self.created:  # a run that failed before writing anything leaves no empty folder behind
                with contextlib.suppress(OSError):
                    self.directory.rmdir()

    def __enter__(self) -> OutputDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def run_lock(output_dir: str | None, *, node_rank: int = 0) -> contextlib.AbstractContextManager[Any]:
    """The run's lock on ``output_dir``, taken once per run before any rank writes (a no-op where not ours).

    The launching process takes it (node 0's, across nodes; ``node_rank``) and the ranks it starts inherit
    the fact (`LOCK_HELD_ENV`); under an external torchrun global rank 0 takes it. Another node's launcher
    takes nothing but marks its ranks as covered too: torchrun's rendezvous may give global rank 0 to any node,
    and with a shared filesystem that rank would otherwise find node 0's lock and refuse its own run. (A dry
    run never gets here.)
    """
    if output_dir is None or LOCK_HELD_ENV in os.environ:
        return contextlib.nullcontext()
    if "WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") != "0":
        return contextlib.nullcontext()
    if "WORLD_SIZE" not in os.environ and node_rank != 0:
        return _covered(f"node 0's launcher ({output_dir})")
    return _held(OutputDirLock(output_dir))


@contextlib.contextmanager
def _covered(holder: str) -> Iterator[None]:
    os.environ[LOCK_HELD_ENV] = holder  # the ranks started from here do not lock
    try:
        yield
    finally:
        os.environ.pop(LOCK_HELD_ENV, None)


@contextlib.contextmanager
def _held(lock: OutputDirLock) -> Iterator[None]:
    with lock:
        os.environ[LOCK_HELD_ENV] = str(lock.path)  # the ranks started from here do not lock again
        try:
            yield
        finally:
            os.environ.pop(LOCK_HELD_ENV, None)
