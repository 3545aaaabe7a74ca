"""Stop at a step boundary on SIGTERM / SIGINT, on every rank at the same step.

The `shardforge` launcher hosts torchrun's agent, which forwards a SIGTERM (or Ctrl-C) to every
rank and waits for them before killing them (30 s in torch's agent). A rank's handler only
records the signal; the trainer asks `StopSignal.requested` once per step, which takes the max
over all ranks (one scalar all-reduce), so every rank sees the request at the same step, saves
a checkpoint there and leaves the loop. The run then resumes from that step.

When a peer rank has already failed (``teardown`` says so, see trainers/watchdog.py), the SIGTERM is
the agent tearing the ranks down: the collective at the step boundary cannot complete, so the rank
raises at once (a rank stuck in Python code exits now, not at the agent's SIGKILL 30 s later).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch.distributed as dist

from shardforge.engine.batching import all_reduce_max

__all__ = ["StopSignal"]

log = logging.getLogger(__name__)

_HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Context manager: while active, SIGTERM/SIGINT set a flag instead of killing the process."""

    def __init__(self, teardown: Callable[[], str | None] | None = None) -> None:
        self.teardown = teardown
        """Returns why a signal now means "exit at once" (a peer rank failed), else None."""
        self.received: int = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():  # signal handlers only go there
            for sig in _HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Ctrl-C reaches a rank twice (from the terminal and from the agent): keep the first. A rank that
        # never reaches the step boundary is killed by the agent after its grace period.
        self.received = self.received or signum
        reason = self.teardown() if self.teardown is not None else None
        if reason:
            message = f"{self.name(signum)} received while {reason}: exiting now, not at a step boundary"
            log.warning("%s", message)  # into this rank's log file: the launcher prints the first failure only
            raise TimeoutError(message)

    def requested(self, device: Any = None) -> int:
        """The signal number if any rank received one (same answer on every rank), else 0."""
        group = dist.group.WORLD if dist.is_initialized() else None
        (value,) = all_reduce_max(float(self.received), group=group, device=device)
        return int(value)

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
