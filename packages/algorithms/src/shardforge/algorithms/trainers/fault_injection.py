"""A test hook that kills one rank once, to prove ``--max-restarts`` + ``resume: auto`` recover.

``SHARDFORGE_FAULT_KILL=RANK:STEP:MARKER`` makes global rank RANK send itself SIGKILL right after
step STEP (after that step's checkpoint, if one is due), unless the file MARKER exists; it creates
MARKER first, so the restarted ranks run on. Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

__all__ = ["FAULT_KILL_ENV", "kill_if_requested"]

FAULT_KILL_ENV = "SHARDFORGE_FAULT_KILL"

log = logging.getLogger(__name__)


def kill_if_requested(step: int) -> None:
    spec = os.environ.get(FAULT_KILL_ENV)
    if not spec:
        return
    rank, at_step, marker = spec.split(":", 2)
    if int(os.environ.get("RANK", "0")) != int(rank) or step != int(at_step) or Path(marker).exists():
        return
    Path(marker).write_text(f"killed rank {rank} after step {step}\n")
    log.warning("%s: rank %s kills itself after step %d", FAULT_KILL_ENV, rank, step)
    os.kill(os.getpid(), signal.SIGKILL)
