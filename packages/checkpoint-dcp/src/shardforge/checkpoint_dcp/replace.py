"""Putting a finished folder (a checkpoint, an export) in place of an existing one without a moment where a crash
loses both, and putting things right at the next start if a crash came in between (`shardforge serve`'s
checkpoints and exports use it).

`replace_folder` renames the old folder aside (``.old-<name>-<hex>``), renames the new one into place, then deletes
the old one (an error in the second rename puts the old one back). A crash (the process killed) between the two
renames leaves the old folder aside and the new one in its staging folder
(``.tmp-<name>-<hex>`` or ``.tmp-<name>``, complete); `recover_replacements`, run when the service starts (never while saves run: a
save in progress has the same shape), puts the new one in place if it is complete (``is_complete``), else the old one
back.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["fsync_dir", "recover_replacements", "replace_folder"]

_OLD, _STAGING = ".old-", ".tmp-"


def replace_folder(staging: Path, target: Path) -> None:
    """Move the folder ``staging`` to ``target``, replacing ``target`` if it exists (see the module doc)."""
    old = target.parent / f"{_OLD}{target.name}-{uuid.uuid4().hex[:8]}" if target.exists() else None
    if old is not None:
        os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        if old is not None:  # an error, not a crash: the old folder goes straight back
            os.replace(old, target)
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old)


def recover_replacements(folders: list[Path], is_complete: Callable[[Path], bool]) -> list[Path]:
    """In each of ``folders``: finish the replacements a crash interrupted (see the module doc); the targets put
    right."""
    recovered = []
    for parent in folders:
        for old in sorted(parent.glob(f"{_OLD}*")):
            name = old.name[len(_OLD) : -9]  # strip the prefix and "-<8 hex>"
            target = parent / name
            if target.exists():  # the replacement had finished: only the old folder's deletion was cut short
                shutil.rmtree(old)
                continue
            staged = [s for s in sorted(parent.glob(f"{_STAGING}{name}*")) if _stages(s.name, name)]
            done = [s for s in staged if is_complete(s)]
            os.replace(done[0] if done else old, target)
            if done:
                shutil.rmtree(old)
            recovered.append(target)
    return recovered


def _stages(folder: str, name: str) -> bool:
    """Whether ``folder`` is a staging folder of ``name``: ``.tmp-<name>-<8 hex>``, or ``.tmp-<name>`` (one fixed
    staging folder per target, as `Checkpointer` uses)."""
    rest = folder[len(_STAGING) + len(name) :]
    return folder.startswith(f"{_STAGING}{name}") and (rest == "" or (len(rest) == 9 and rest[0] == "-"))


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path`` (its entries: a rename or a new file in it survives a power cut); a directory
    that cannot be opened is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
