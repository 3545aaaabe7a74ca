"""`Checkpointer`: crash-safe, optionally asynchronous DCP checkpoints with keep-last-N.

Layout under ``root``::

    step_00000010/          a committed checkpoint (DCP files + .metadata + COMMITTED)
    .tmp-step_00000012/     a save in progress (or one a crash interrupted): never loaded

A save writes into the temporary directory; when every rank has finished (DCP's final
collective writes ``.metadata``), rank 0 writes the ``COMMITTED`` marker, fsyncs, and
renames the directory into place. Only directories with the marker count, so a crash at
any point leaves the previous checkpoint as the latest. Retention never removes the
newest committed checkpoint.

Async saves stage a copy of the state (so training may mutate parameters right away),
write in a background thread over a dedicated gloo process group (so the writer's
collectives never interleave with training's), and are committed by `wait()`, which runs
before the next save, before a load, and in `close()`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from shardforge.checkpoint_dcp.replace import fsync_dir, recover_replacements, replace_folder
from shardforge.checkpoint_dcp.validate import CorruptCheckpointError, check_compatible, verify_files

__all__ = ["COMMIT_MARKER", "AsyncMode", "Checkpointer"]

logger = logging.getLogger(__name__)

AsyncMode = Literal["off", "async", "async_pinned"]
COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def _step_dir(step: int) -> str:
    return f"step_{step:08d}"


class Checkpointer:
    """Save and load `Stateful` train states under ``root``. Every rank constructs it.

    Args:
        root: directory holding the checkpoints (shared by all ranks).
        keep_last: keep this many newest committed checkpoints (None = keep all).
        async_mode: "off" (save blocks), "async" (background write), or "async_pinned"
            (background write, staging into pinned memory when CUDA is present).
    """

    def __init__(
        self, root: str | os.PathLike[str], *, keep_last: int | None = 3, async_mode: AsyncMode = "off"
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1 (or None to keep everything)")
        if async_mode not in ("off", "async", "async_pinned"):
            raise ValueError(f"async_mode={async_mode!r}; valid: 'off', 'async', 'async_pinned'")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_mode: AsyncMode = async_mode
        self._pending: tuple[int, Any] | None = None
        self._async_group: dist.ProcessGroup | None = None
        if dist.is_initialized() and async_mode != "off":
            # Collective: every rank creates the checkpointer at the same point.
            self._async_group = dist.new_group(backend="gloo")
        if self._is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            # a step replaced by a process killed between its two renames: finished before any rank reads or saves
            for step_dir in recover_replacements([self.root], lambda staged: (staged / COMMIT_MARKER).is_file()):
                logger.warning("finished the replacement of %s that a crash had interrupted", step_dir)
        self._barrier()
        self.last_save_blocking_s = 0.0
        """Seconds the last `save` call blocked the caller."""
        self._stager = _ReusableStager()

    # ------------------------------------------------------------------ helpers
    @property
    def _is_main(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def committed_steps(self) -> list[int]:
        """Steps of all committed checkpoints, ascending."""
        if not self.root.is_dir():
            return []
        steps = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / COMMIT_MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def latest_valid_step(self) -> int | None:
        """The newest committed step whose files pass `verify_files`; each skipped one is logged."""
        for step in reversed(self.committed_steps()):
            try:
                verify_files(self.path(step))
            except CorruptCheckpointError as exc:
                logger.warning("skipping a damaged checkpoint: %s", exc)
                continue
            return step
        return None

    def path(self, step: int) -> Path:
        return self.root / _step_dir(step)

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Save ``state`` (e.g. ``{"train": TrainState(...)}``) as checkpoint ``step``. Collective."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        started = time.perf_counter()
        self.wait()
        final = self.path(step)
        tmp = self.root / f".tmp-{_step_dir(step)}"
        if self._is_main:
            if tmp.exists():
                shutil.rmtree(tmp)  # left over from an interrupted save
            tmp.mkdir(parents=True)
        self._barrier()
        writer = dcp.FileSystemWriter(str(tmp), thread_count=2)
        if self.async_mode == "off":
            dcp.save(dict(state), storage_writer=writer, no_dist=not dist.is_initialized())
            self._commit(step, tmp, final)
        else:
            kwargs: dict[str, Any] = {
                "storage_writer": writer,
                "process_group": self._async_group,
                "no_dist": not dist.is_initialized(),
            }
            if self.async_mode == "async":
                kwargs["async_stager"] = self._stager
            else:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                pinned = torch.cuda.is_available()
                kwargs["async_stager"] = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=pinned,
                        use_shared_memory=False,
                        use_async_staging=pinned,
                        use_non_blocking_copy=pinned,
                    )
                )
            response = dcp.async_save(dict(state), **kwargs)
            self._pending = (step, response)
            staged = getattr(response, "staging_completion", None)
            if staged is not None:
                # Async staging (CUDA) copies in a background thread: training must not
                # mutate the state (optimizer step) before the copy is complete.
                staged.result()
        self.last_save_blocking_s = time.perf_counter() - started

    def wait(self) -> None:
        """Finish and commit a pending async save (no-op if none). Collective."""
        if self._pending is None:
            return
        step, response = self._pending
        self._pending = None
        future: Future[Any] = getattr(response, "upload_completion", response)
        future.result()
        self._commit(step, self.root / f".tmp-{_step_dir(step)}", self.path(step))

    def _commit(self, step: int, tmp: Path, final: Path) -> None:
        self._barrier()  # every rank's shards are on disk
        if self._is_main:
            marker = tmp / COMMIT_MARKER
            with marker.open("w") as handle:
                json.dump({"step": step, "time": time.time()}, handle)
                handle.flush()
                os.fsync(handle.fileno())
            fsync_dir(tmp)
            replace_folder(tmp, final)  # a step saved again: the old one goes aside first, never lost (`replace`)
            self._prune()
        self._barrier()

    def _prune(self) -> None:
        for child in self.root.iterdir():
            if child.name.startswith(".tmp-") and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
        if self.keep_last is None:
            return
        steps = self.committed_steps()
        for old in steps[: max(len(steps) - self.keep_last, 0)]:
            shutil.rmtree(self.path(old), ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, state: Mapping[str, Any], step: int | Literal["latest"] = "latest") -> int | None:
        """Load checkpoint ``step`` (or the newest committed one) into ``state`` in place.

        Returns the loaded step, or None when ``step="latest"`` and nothing is committed.
        Raises `FileNotFoundError` for an explicit step that is not committed, and
        `ValueError` naming missing/unexpected/mis-shaped keys for an incompatible model.
        """
        self.wait()
        if step == "latest":
            latest = self.latest_step()
            if latest is None:
                return None
            step = latest
        path = self.path(step)
        if not (path / COMMIT_MARKER).is_file():
            raise FileNotFoundError(
                f"no committed checkpoint for step {step} under {self.root} (committed steps: {self.committed_steps()})"
            )
        try:
            verify_files(path)
        except CorruptCheckpointError as exc:
            older = [s for s in self.committed_steps() if s < step]
            hint = (
                f"; resume from the previous one with resume=latest_valid (newest older step: {older[-1]}), or delete "
                f"{path}"
                if older
                else f"; no older committed checkpoint exists under {self.root}: delete {path} to start over"
            )
            raise CorruptCheckpointError(f"{exc}{hint}") from exc
        check_compatible(dict(state), path)
        loaded = dict(state)
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(path)))
        if isinstance(state, MutableMapping):
            # DCP loads tensors and Stateful values in place but replaces other values
            # (ints, strings, other objects) in the dict it is given: copy them back.
            state.update(loaded)
        return step

    def close(self) -> None:
        """Wait for and commit any pending save. Call at the end of training on every rank."""
        self.wait()


class _ReusableStager(BlockingAsyncStager):
    """Stages into one CPU copy of the state that is reused by every async save.

    Allocating (and page-faulting) a fresh copy each time costs as much as writing it;
    reusing the buffers makes the blocking part a plain memcpy. The cache is rebuilt when
    the state's structure changes (e.g. optimizer state appears after the first step).
    Safe because `Checkpointer.save` waits for the previous save before staging again.
    """

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=True)
        self._signature: tuple[Any, ...] | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # torch's private helpers are what BlockingAsyncStager itself uses; we call them to
        # pin only when CUDA exists (pinning without an accelerator raises).
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        signature = _structure(state_dict)
        if signature != self._signature or self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._signature = signature
        return _copy_state_dict(state_dict, self.state_dict_cache)  # type: ignore[no-any-return]


def _structure(value: Any) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return ("d", tuple((k, _structure(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("l", tuple(_structure(v) for v in value))
    return ("o", type(value).__name__)
