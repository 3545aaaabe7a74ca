"""``save_state`` / ``load_state``: a training model's trained weights and AdamW state as a DCP checkpoint under
``<output_dir>/<tenant>/<model_id>/weights/<name>/`` (``tinker://<model_id>/weights/<name>``; the format:
`serve.dcp_state`). A tenant loads only from its own folder.

Checkpoints of earlier versions of the service (one ``state.pt`` per folder, written with ``torch.save``) still
list, load and delete; a full fine-tuning one loads on one rank only (it holds unsharded tensors by position in
the optimizer, which a sharded model cannot take: load it on one rank and save it again to move it to DCP).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from shardforge.algorithms.serve.dcp_state import (
    META_FILE,
    ModelState,
    check_dcp,
    is_dcp_checkpoint,
    load_dcp,
    read_meta,
    save_dcp,
)
from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.models import TrainingModel
from shardforge.checkpoint_dcp import COMMIT_MARKER
from shardforge.checkpoint_dcp.replace import recover_replacements
from shardforge.lora import LoRAConfig

__all__ = [
    "check_loadable", "check_name", "checkpoint_dir", "checkpoint_folder", "checkpoint_meta", "delete_checkpoint",
    "is_legacy", "list_training_checkpoints", "load_state", "read_checkpoint_info", "read_into", "read_lora",
    "recover_interrupted_saves", "save_state", "save_target", "write_state",
]  # fmt: skip

log = logging.getLogger(__name__)

_LEGACY_FILE = "state.pt"
"""The one file of a checkpoint of an earlier service version."""


def check_name(name: str, what: str = "checkpoint name") -> str:
    """``name`` if it is safe as one folder name under the service's output directory, else a UserError."""
    if not name or "/" in name or name.startswith(".") or ".." in name:
        raise UserError(f"{what} {name!r} must be non-empty, without '/' or '..', not starting with '.'")
    return name


def checkpoint_dir(root: Path, tenant: str, model_id: str, name: str) -> Path:
    return root / tenant / check_name(model_id) / "weights" / check_name(name)


def _is_checkpoint(folder: Path) -> bool:
    return is_dcp_checkpoint(folder) or (folder / _LEGACY_FILE).is_file()


def is_legacy(folder: Path) -> bool:
    """Whether the checkpoint ``folder`` is an earlier version's ``state.pt`` (not DCP)."""
    return not is_dcp_checkpoint(folder) and (folder / _LEGACY_FILE).is_file()


def save_target(root: Path, model: TrainingModel, request: dict[str, Any]) -> tuple[str, Path]:
    """The name and folder a ``save_state`` request writes; UserError if it exists and may not be overwritten."""
    name = str(request.get("path") or f"step-{model.steps:06d}")
    target = checkpoint_dir(root, model.owner, model.model_id, name)
    if target.exists() and not request.get("overwrite", False):
        raise UserError(f"checkpoint {name!r} of {model.model_id} exists; pass another name or overwrite=True")
    target.parent.mkdir(parents=True, exist_ok=True)
    return name, target


def checkpoint_meta(model: TrainingModel) -> dict[str, Any]:
    """``serve.json``: what a checkpoint says about its run."""
    return {
        "rank": None if model.lora is None else model.lora.r,  # None: full fine-tuning
        "target_modules": [] if model.lora is None else list(model.lora.target_modules),
        "steps": model.steps, "base_model": model.base_model, "user_metadata": dict(model.user_metadata),
    }  # fmt: skip


def write_state(target: Path, model: TrainingModel, *, collective: bool = False) -> None:
    """Write ``model`` as the checkpoint ``target`` (``collective``: every rank, a sharded model; `save_dcp`)."""
    save_dcp(target, ModelState(model.module, model.optimizer), checkpoint_meta(model), collective=collective)


def save_state(root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]:
    """``save_state`` of a model this process holds whole (one rank, or replicated adapters)."""
    name, target = save_target(root, model, request)
    write_state(target, model)
    return {"type": "save_weights", "path": f"tinker://{model.model_id}/weights/{name}"}


def list_training_checkpoints(root: Path, tenant: str, model_id: str) -> list[dict[str, Any]]:
    """``save_state`` checkpoints of ``model_id`` on disk (also those of a previous service run), as the SDK's
    ``Checkpoint`` JSON, oldest first; another tenant's model lists nothing."""
    import datetime

    folder = root / tenant / check_name(model_id) / "weights"
    out = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if path.name.startswith(".") or not _is_checkpoint(path):  # a save or a delete in progress
            continue
        stamp = path / (_LEGACY_FILE if is_legacy(path) else META_FILE)
        files = [f for f in path.rglob("*") if f.is_file()]
        out.append({
            "checkpoint_id": f"weights/{path.name}", "checkpoint_type": "training",
            "time": datetime.datetime.fromtimestamp(stamp.stat().st_mtime, datetime.UTC).isoformat(),
            "tinker_path": f"tinker://{model_id}/weights/{path.name}",
            "size_bytes": sum(f.stat().st_size for f in files),
        })  # fmt: skip
    return sorted(out, key=lambda c: c["time"])


def delete_checkpoint(root: Path, tenant: str, model_id: str, name: str) -> None:
    """Remove the ``save_state`` checkpoint ``tinker://<model_id>/weights/<name>`` of ``tenant`` (KeyError when it
    has none such). Renamed out of place first, so a concurrent load sees it whole or not at all."""
    target = checkpoint_dir(root, tenant, model_id, name)
    if not _is_checkpoint(target):
        raise KeyError(f"checkpoint tinker://{model_id}/weights/{name} is not a checkpoint of this API key")
    trash = target.parent / f".tmp-deleted-{target.name}-{uuid.uuid4().hex[:8]}"
    os.replace(target, trash)
    shutil.rmtree(trash)


def checkpoint_folder(root: Path, tenant: str, path: str) -> Path:
    """The folder of the ``save_state`` path ``path`` of ``tenant``; UserError for a malformed path, KeyError when
    the tenant has no such checkpoint."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights":
        raise UserError(f"path={path!r} must be a save_state path, tinker://<model_id>/weights/<name>")
    folder = checkpoint_dir(root, tenant, parts[0], parts[2])
    if not _is_checkpoint(folder):  # another tenant's checkpoint reads as missing: it is not under this tenant's folder
        raise KeyError(f"checkpoint {path!r} is not a checkpoint of this API key")
    return folder


def _info(folder: Path) -> dict[str, Any]:
    """The run a checkpoint describes: ``rank``, ``target_modules``, ``steps``, ``base_model``, ``user_metadata``."""
    if not is_legacy(folder):
        return read_meta(folder)
    state = torch.load(folder / _LEGACY_FILE, map_location="cpu", weights_only=True)
    keys = ("base_model", "rank", "steps", "target_modules")
    return {key: state.get(key) for key in keys} | {"user_metadata": dict(state.get("user_metadata") or {})}


def read_checkpoint_info(root: Path, tenant: str, path: str) -> dict[str, Any]:
    """What a ``save_state`` checkpoint says about its run, without its tensors: ``base_model``, ``rank`` (None:
    full fine-tuning), ``steps`` and ``user_metadata`` (empty in checkpoints saved before it was kept)."""
    info = _info(checkpoint_folder(root, tenant, path))
    return {key: info.get(key) for key in ("base_model", "rank", "steps")} | {
        "user_metadata": dict(info.get("user_metadata") or {})
    }


def read_lora(root: Path, tenant: str, request: dict[str, Any], *, alpha: float) -> LoRAConfig | None:
    """The LoRA config of the checkpoint ``request["path"]`` (to create the model it is loaded into); None: the
    checkpoint is a full fine-tuning one."""
    info = _info(checkpoint_folder(root, tenant, str(request.get("path", ""))))
    if info["rank"] is None:
        return None
    return LoRAConfig(r=int(info["rank"]), alpha=alpha, target_modules=tuple(info["target_modules"]))


def check_loadable(root: Path, model: TrainingModel, request: dict[str, Any], *, files: bool = False) -> Path:
    """The folder of the checkpoint ``request["path"]``; UserError unless its LoRA config is ``model``'s (and, with
    ``files``, unless its files are whole and its parameter names and shapes are ``model``'s: `check_dcp`, for a
    caller that must know before every rank starts loading)."""
    path = str(request.get("path", ""))
    folder = checkpoint_folder(root, model.owner, path)
    info = _info(folder)
    rank, targets = (None, []) if model.lora is None else (model.lora.r, list(model.lora.target_modules))
    if info["rank"] != rank or list(info["target_modules"]) != targets:
        raise UserError(
            f"checkpoint {path!r} has LoRA rank {info['rank']} on {info['target_modules']}; this model has rank "
            f"{rank} on {targets} (rank None: full fine-tuning): create the training client with the same config"
        )
    if files and not is_legacy(folder):
        try:
            check_dcp(folder, ModelState(model.module, None))
        except ValueError as exc:
            raise UserError(f"checkpoint {path!r} cannot be loaded: {exc}") from exc
    return folder


def read_into(folder: Path, model: TrainingModel, *, optimizer: bool, collective: bool = False) -> None:
    """Load the checkpoint ``folder`` (checked by `check_loadable`) into ``model``: its weights, and with
    ``optimizer`` its AdamW state and step count; without, the optimizer starts afresh (no moments, step 0), as the
    SDK documents for ``load_state`` (``collective``: every rank, a sharded model)."""
    if is_legacy(folder):
        _read_legacy(folder, model, optimizer=optimizer)
    else:
        load_dcp(folder, ModelState(model.module, model.optimizer if optimizer else None), collective=collective)
        if optimizer:
            model.steps = int(read_meta(folder)["steps"])
    if not optimizer:
        model.optimizer.state.clear()
        model.steps = 0
    model.optimizer.zero_grad(set_to_none=True)


def _read_legacy(folder: Path, model: TrainingModel, *, optimizer: bool) -> None:
    state = torch.load(folder / _LEGACY_FILE, map_location="cpu", weights_only=True)
    params = dict(model.module.named_parameters())
    with torch.no_grad():
        for name, value in state["adapter"].items():
            params[name].copy_(value)
    if optimizer:
        model.optimizer.load_state_dict(state["optimizer"])
        model.steps = int(state["steps"])


def load_state(root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]:
    """``load_state`` into a model this process holds whole (one rank, or replicated adapters)."""
    folder = check_loadable(root, model, request, files=True)
    read_into(folder, model, optimizer=bool(request.get("optimizer")))
    return {"type": "load_weights", "path": str(request.get("path", "")), "model_id": model.model_id}


def recover_interrupted_saves(root: Path) -> None:
    """Finish the checkpoint and export replacements that a crash of the previous service cut short
    (`checkpoint_dcp.replace`; run once at start, before any save): a complete new checkpoint goes in place, else the
    old one back; an export is rewritten on request, so its old folder goes back."""
    folders = sorted(root.glob("*/*/weights"))
    exports = sorted(root.glob("*/*/external_weights"))
    recovered = recover_replacements(folders, lambda staged: (staged / COMMIT_MARKER).is_file())
    recovered += recover_replacements(exports, lambda staged: False)
    for target in recovered:
        log.warning("shardforge serve: finished the replacement of %s that a crash had interrupted", target)
