"""Test hooks: kill one rank once (``--max-restarts`` + ``resume: auto`` recover), or make one rank hang.

``SHARDFORGE_FAULT_KILL=RANK:STEP:MARKER`` makes global rank RANK send itself SIGKILL right after
step STEP (after that step's checkpoint, if one is due), unless the file MARKER exists; it creates
MARKER first, so the restarted ranks run on. ``SHARDFORGE_FAULT_SLEEP=RANK:STEP:SECONDS`` makes
global rank RANK sleep SECONDS at the start of step STEP (a stuck rank: its peers' collective times
out, trainers/watchdog.py). ``SHARDFORGE_FAULT_KILL_ROLLOUT=INDEX:CALL`` makes HF rollout actor INDEX
(``rollout_placement: disaggregated``) send itself SIGKILL in its CALL-th generate call (1-based), with that
request in flight; a Ray actor is not restarted, so it dies once (the variable reaches actors on the driver's
node, which inherit its environment). Unset (always, outside tests) they do nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

__all__ = [
    "FAULT_KILL_ENV",
    "FAULT_KILL_ROLLOUT_ENV",
    "FAULT_SLEEP_ENV",
    "kill_if_requested",
    "kill_rollout_actor_if_requested",
    "sleep_if_requested",
]

FAULT_KILL_ENV = "SHARDFORGE_FAULT_KILL"
FAULT_SLEEP_ENV = "SHARDFORGE_FAULT_SLEEP"
FAULT_KILL_ROLLOUT_ENV = "SHARDFORGE_FAULT_KILL_ROLLOUT"

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


def sleep_if_requested(step: int) -> None:
    spec = os.environ.get(FAULT_SLEEP_ENV)
    if not spec:
        return
    rank, at_step, seconds = spec.split(":", 2)
    if int(os.environ.get("RANK", "0")) != int(rank) or step != int(at_step):
        return
    log.warning("%s: rank %s sleeps %s s in step %d", FAULT_SLEEP_ENV, rank, seconds, step)
    time.sleep(float(seconds))


def kill_rollout_actor_if_requested(index: int, call: int) -> None:
    spec = os.environ.get(FAULT_KILL_ROLLOUT_ENV)
    if not spec:
        return
    actor, at_call = spec.split(":", 1)
    if index != int(actor) or call != int(at_call):
        return
    log.warning("%s: rollout actor %d kills itself in generate call %d", FAULT_KILL_ROLLOUT_ENV, index, call)
    os.kill(os.getpid(), signal.SIGKILL)
