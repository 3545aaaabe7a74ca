"""Test faults: kill one rank once (``--max-restarts`` + ``resume: auto`` recover), or make one rank hang.

``SHARDFORGE_FAULT_KILL=RANK:STEP:MARKER`` makes global rank RANK send itself SIGKILL right after
step STEP (after that step's checkpoint, if one is due), unless the file MARKER exists; it creates
MARKER first, so the restarted ranks run on. ``SHARDFORGE_FAULT_SLEEP=RANK:STEP:SECONDS`` makes
global rank RANK sleep SECONDS at the start of step STEP (a stuck rank: its peers' collective times
out, trainers/watchdog.py). ``SHARDFORGE_FAULT_KILL_ROLLOUT=INDEX:CALL`` makes HF rollout actor INDEX
(``rollout.placement: disaggregated``) send itself SIGKILL in its CALL-th generate call (1-based), with that
request in flight; a Ray actor is not restarted, so it dies once (the variable reaches actors on the driver's
node, which inherit its environment). ``SHARDFORGE_FAULT_FAIL_SAVE=RANK:MARKER`` makes global rank RANK fail its
write of the next checkpoint (`checkpoint_write`: `shardforge serve`'s ``save_state``) with an OSError, as a full
disk would, unless MARKER exists; it creates MARKER, so the next save succeeds. Unset (always, outside tests) they
do nothing.

Production code only fires hook points (`shardforge.core.hooks`); importing this module registers the faults
on them. A test names it in ``SHARDFORGE_HOOKS`` next to the fault variables (`fault_env`), so the torchrun
ranks and Ray actors it starts import it at their first hook point.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from shardforge.core import hooks

__all__ = [
    "FAULT_FAIL_SAVE_ENV",
    "FAULT_KILL_ENV",
    "FAULT_KILL_ROLLOUT_ENV",
    "FAULT_SLEEP_ENV",
    "fail_save_if_requested",
    "fault_env",
    "kill_if_requested",
    "kill_rollout_actor_if_requested",
    "sleep_if_requested",
]

FAULT_KILL_ENV = "SHARDFORGE_FAULT_KILL"
FAULT_SLEEP_ENV = "SHARDFORGE_FAULT_SLEEP"
FAULT_KILL_ROLLOUT_ENV = "SHARDFORGE_FAULT_KILL_ROLLOUT"
FAULT_FAIL_SAVE_ENV = "SHARDFORGE_FAULT_FAIL_SAVE"

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


def fail_save_if_requested(rank: int, path: str) -> None:
    spec = os.environ.get(FAULT_FAIL_SAVE_ENV)
    if not spec:
        return
    at_rank, marker = spec.split(":", 1)
    if rank != int(at_rank) or Path(marker).exists():
        return
    Path(marker).write_text(f"failed rank {rank}'s write of {path}\n")
    log.warning("%s: rank %d fails its checkpoint write into %s", FAULT_FAIL_SAVE_ENV, rank, path)
    raise OSError(28, f"No space left on device (injected by {FAULT_FAIL_SAVE_ENV})")


def fault_env(**faults: str) -> dict[str, str]:
    """The environment that arms ``faults`` in the processes a test starts: ``fault_env(SHARDFORGE_FAULT_KILL="1:3:m")``
    is that variable plus ``SHARDFORGE_HOOKS`` naming this module."""
    valid = {FAULT_KILL_ENV, FAULT_SLEEP_ENV, FAULT_KILL_ROLLOUT_ENV, FAULT_FAIL_SAVE_ENV}
    unknown = set(faults) - valid
    if unknown:
        raise ValueError(f"unknown fault variables {sorted(unknown)}; valid: {', '.join(sorted(valid))}")
    return {hooks.HOOKS_ENV: __name__, **faults}


hooks.register("step_start", sleep_if_requested)
hooks.register("step_end", kill_if_requested)
hooks.register("rollout_generate", kill_rollout_actor_if_requested)
hooks.register("checkpoint_write", fail_save_if_requested)
