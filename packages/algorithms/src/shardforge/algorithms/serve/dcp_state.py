"""The ``save_state`` checkpoint format: one DCP checkpoint (`torch.distributed.checkpoint`, the files our
trainers write through `shardforge.checkpoint_dcp`) per ``tinker://<model_id>/weights/<name>`` folder::

    <output_dir>/<tenant>/<model_id>/weights/<name>/
        .metadata  __0_0.distcp ...   DCP: the trained weights and the AdamW state, by parameter name
        COMMITTED                      `checkpoint_dcp.COMMIT_MARKER`: the save finished
        serve.json                     the run: LoRA rank and targets (null: full fine-tuning), steps, base model,
                                       user_metadata

Keys are fully qualified parameter names (``get_state_dict``), never rank-local ones, so a checkpoint saved on N
ranks loads on M: DCP reshards a full fine-tuning model's FSDP shards on load. A LoRA model's adapters are
replicated, so rank 0 writes them alone; a full fine-tuning model's shards are written by every rank together.

A save is atomic: DCP writes into a hidden staging folder next to the target, rank 0 adds the marker and
``serve.json``, fsyncs, and renames it into place (`checkpoint_dcp.replace`: an overwritten checkpoint is renamed aside
first), so a crash leaves the previous checkpoint or the new one.

Unlike `checkpoint_dcp.TrainState`, nothing here saves or restores RNG state: the service's generators are shared
by every tenant, and loading one tenant's checkpoint must not reset them for the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardforge.checkpoint_dcp import COMMIT_MARKER, check_compatible, verify_files
from shardforge.checkpoint_dcp import TrainableState as ModelState
from shardforge.checkpoint_dcp.replace import fsync_dir, replace_folder
from shardforge.core import hooks

__all__ = ["META_FILE", "ModelState", "check_dcp", "is_dcp_checkpoint", "load_dcp", "read_meta", "save_dcp"]

META_FILE = "serve.json"
"""The run's description next to the DCP files (read without loading a tensor)."""

_FORMAT = "shardforge-serve-dcp/1"


def is_dcp_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a committed checkpoint of this format."""
    return (folder / COMMIT_MARKER).is_file() and (folder / META_FILE).is_file()


def read_meta(folder: Path) -> dict[str, Any]:
    """``serve.json`` of the checkpoint ``folder``."""
    meta: dict[str, Any] = json.loads((folder / META_FILE).read_text())
    return meta


def save_dcp(target: Path, state: ModelState, meta: dict[str, Any], *, collective: bool) -> None:
    """Write ``state`` and ``meta`` as the checkpoint ``target`` (replaced if it exists). ``collective``: every rank
    of the default process group calls this together (sharded state); else this process writes alone."""
    main = not collective or dist.get_rank() == 0
    name = f".tmp-{target.name}-{uuid.uuid4().hex[:8]}" if main else ""
    staging = target.parent / name
    if main:
        try:
            staging.mkdir(parents=True)
        except OSError as exc:  # told to every rank below, so none waits in a collective rank 0 never joins
            name = f"error: cannot create {staging}: {exc}"
    if collective:  # every rank writes into rank 0's staging folder
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    if name.startswith("error: "):
        raise OSError(name.removeprefix("error: "))
    staging = target.parent / name
    try:
        with _quiet(collective):
            try:
                dcp.save({"train": state}, storage_writer=_Writer(str(staging)), no_dist=not collective)
            except CheckpointException as exc:  # a BaseException: as an OSError, the request's error (any rank's)
                failed = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in exc.failures.items())
                raise OSError(f"the checkpoint write failed ({failed})") from None
        if collective:
            dist.barrier()  # every rank's files are on disk
        if main:
            (staging / META_FILE).write_text(json.dumps(meta | {"format": _FORMAT}, sort_keys=True))
            with (staging / COMMIT_MARKER).open("w") as handle:
                handle.write("{}")
                handle.flush()
                os.fsync(handle.fileno())
            fsync_dir(staging)
            replace_folder(staging, target)  # a crash from here on loses neither checkpoint (`checkpoint_dcp.replace`)
    finally:
        if main and staging.exists():
            shutil.rmtree(staging)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, firing the ``checkpoint_write`` hook point first (`shardforge.core.hooks`): a failure
    there is one of the write step, which DCP gathers and raises on every rank, as it does a full disk."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        hooks.fire("checkpoint_write", rank=dist.get_rank() if dist.is_initialized() else 0, path=str(self.path))
        return super().write_data(plan, planner)


def check_dcp(folder: Path, state: ModelState) -> None:
    """ValueError (`checkpoint_dcp.CorruptCheckpointError` for damaged files) naming what is wrong unless the
    checkpoint ``folder`` loads into ``state``; reads no tensor and runs no collective."""
    verify_files(folder)
    check_compatible({"train": state}, folder)


def load_dcp(folder: Path, state: ModelState, *, collective: bool) -> None:
    """Load the checkpoint ``folder`` into ``state`` in place (``collective``: as in `save_dcp`), after
    `check_dcp`."""
    check_dcp(folder, state)
    with _quiet(collective):
        dcp.load({"train": state}, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=not collective)


@contextlib.contextmanager
def _quiet(collective: bool) -> Iterator[None]:
    """DCP warns that a save or load without a process group is meant for one process: here it is."""
    with warnings.catch_warnings():
        if not collective:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
