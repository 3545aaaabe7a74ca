"""Check a checkpoint against the model it is loaded into, before any tensor is read."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

__all__ = ["CorruptCheckpointError", "check_compatible", "checkpoint_tensor_shapes", "verify_files"]

_MAX_LISTED = 20


class CorruptCheckpointError(ValueError):
    """A committed checkpoint whose files cannot be what its index says (names the file)."""


def verify_files(path: str | Path) -> None:
    """Raise `CorruptCheckpointError` naming the file if ``path``'s index or data files are unreadable.

    Checks that ``.metadata`` unpickles and that every data file it points at exists and is at
    least as long as the byte ranges it indexes: what a crash, a full disk or a partial copy leaves.
    DCP keeps no checksums, so flipped bytes inside a file of the right length are not detected.
    """
    path = Path(path)
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a truncated pickle raises EOFError, UnpicklingError, ...
        raise CorruptCheckpointError(
            f"checkpoint {path}: its index {path / '.metadata'} cannot be read ({type(exc).__name__}: {exc})"
        ) from exc
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative, size in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            raise CorruptCheckpointError(f"checkpoint {path}: data file {file} is missing")
        actual = file.stat().st_size
        if actual < size:
            raise CorruptCheckpointError(
                f"checkpoint {path}: data file {file} is truncated ({actual} bytes; its index needs {size})"
            )


def checkpoint_tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Flattened key -> global shape of every tensor in a DCP checkpoint directory."""
    metadata = FileSystemReader(str(path)).read_metadata()
    return {
        key: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def check_compatible(state: Mapping[str, Any], path: str | Path) -> None:
    """Raise `ValueError` listing missing, unexpected and mis-shaped model keys.

    Looks at every value of ``state`` that has a ``model`` attribute (a `TrainState`) and
    compares its parameter names and global shapes with the checkpoint's ``<key>.model.*``.
    """
    saved = checkpoint_tensor_shapes(path)
    for name, value in state.items():
        model = getattr(value, "model", None)
        if not isinstance(model, torch.nn.Module):
            continue
        prefix = f"{name}.model."
        # A TrainState(trainable_only=True) saves and loads only trainable params.
        options = StateDictOptions(full_state_dict=False, ignore_frozen_params=getattr(value, "trainable_only", False))
        expected = {
            k: tuple(v.shape)
            for k, v in get_model_state_dict(model, options=options).items()
            if isinstance(v, torch.Tensor)
        }
        have = {k[len(prefix) :]: shape for k, shape in saved.items() if k.startswith(prefix)}
        missing = sorted(set(expected) - set(have))
        unexpected = sorted(set(have) - set(expected))
        mismatched = sorted(k for k in set(expected) & set(have) if expected[k] != have[k])
        if missing or unexpected or mismatched:
            parts = [f"checkpoint {path} does not match the model ({type(model).__name__}):"]
            if missing:
                parts.append(f"missing in checkpoint ({len(missing)}): {missing[:_MAX_LISTED]}")
            if unexpected:
                parts.append(f"unexpected in checkpoint ({len(unexpected)}): {unexpected[:_MAX_LISTED]}")
            if mismatched:
                details = [f"{k}: checkpoint {have[k]} vs model {expected[k]}" for k in mismatched[:_MAX_LISTED]]
                parts.append(f"shape mismatch ({len(mismatched)}): {details}")
            parts.append("load a checkpoint saved from the same model architecture (layout may differ)")
            raise ValueError("\n  ".join(parts))
