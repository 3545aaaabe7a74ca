"""``save_state`` / ``load_state``: a training model's adapters and AdamW state under
``<output_dir>/<tenant>/<model_id>/weights/<name>/state.pt`` (``tinker://<model_id>/weights/<name>``).

A save is atomic: written into a temporary folder next to the target and renamed into place, so a crash
leaves either the previous checkpoint or the new one. A tenant loads only from its own folder.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.models import TrainingModel
from shardforge.lora import LoRAConfig

__all__ = [
    "check_name", "checkpoint_dir", "delete_checkpoint", "list_training_checkpoints", "load_state", "read_checkpoint_info",
    "read_lora", "save_state",
]  # fmt: skip

_STATE_FILE = "state.pt"


def check_name(name: str, what: str = "checkpoint name") -> str:
    """``name`` if it is safe as one folder name under the service's output directory, else a UserError."""
    if not name or "/" in name or name.startswith(".") or ".." in name:
        raise UserError(f"{what} {name!r} must be non-empty, without '/' or '..', not starting with '.'")
    return name


def checkpoint_dir(root: Path, tenant: str, model_id: str, name: str) -> Path:
    return root / tenant / check_name(model_id) / "weights" / check_name(name)


def save_state(root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]:
    name = request.get("path") or f"step-{model.steps:06d}"
    target = checkpoint_dir(root, model.owner, model.model_id, str(name))
    if target.exists() and not request.get("overwrite", False):
        raise UserError(f"checkpoint {name!r} of {model.model_id} exists; pass another name or overwrite=True")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        state = {
            "adapter": model.adapter_state(),
            "optimizer": model.optimizer.state_dict(),
            "rank": None if model.lora is None else model.lora.r,  # None: full fine-tuning
            "target_modules": [] if model.lora is None else list(model.lora.target_modules),
            "steps": model.steps,
            "base_model": model.base_model,
            "user_metadata": dict(model.user_metadata),
        }
        torch.save(state, staging / _STATE_FILE)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return {"type": "save_weights", "path": f"tinker://{model.model_id}/weights/{name}"}


def list_training_checkpoints(root: Path, tenant: str, model_id: str) -> list[dict[str, Any]]:
    """``save_state`` checkpoints of ``model_id`` on disk (also those of a previous service run), as the SDK's
    ``Checkpoint`` JSON, oldest first; another tenant's model lists nothing."""
    import datetime

    folder = root / tenant / check_name(model_id) / "weights"
    out = []
    for path in folder.glob(f"*/{_STATE_FILE}") if folder.is_dir() else ():
        stat = path.stat()
        out.append({
            "checkpoint_id": f"weights/{path.parent.name}", "checkpoint_type": "training",
            "time": datetime.datetime.fromtimestamp(stat.st_mtime, datetime.UTC).isoformat(),
            "tinker_path": f"tinker://{model_id}/weights/{path.parent.name}", "size_bytes": stat.st_size,
        })  # fmt: skip
    return sorted(out, key=lambda c: c["time"])


def delete_checkpoint(root: Path, tenant: str, model_id: str, name: str) -> None:
    """Remove the ``save_state`` checkpoint ``tinker://<model_id>/weights/<name>`` of ``tenant`` (KeyError when it
    has none such). Renamed out of place first, so a concurrent load sees it whole or not at all."""
    target = checkpoint_dir(root, tenant, model_id, name)
    if not (target / _STATE_FILE).is_file():
        raise KeyError(f"checkpoint tinker://{model_id}/weights/{name} is not a checkpoint of this API key")
    trash = target.parent / f".tmp-deleted-{target.name}-{uuid.uuid4().hex[:8]}"
    os.replace(target, trash)
    shutil.rmtree(trash)


def _state_file(root: Path, tenant: str, path: str) -> Path:
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights":
        raise UserError(f"path={path!r} must be a save_state path, tinker://<model_id>/weights/<name>")
    file = checkpoint_dir(root, tenant, parts[0], parts[2]) / _STATE_FILE
    if not file.is_file():  # another tenant's checkpoint reads as missing: it is not under this tenant's folder
        raise KeyError(f"checkpoint {path!r} is not a checkpoint of this API key")
    return file


def read_checkpoint_info(root: Path, tenant: str, path: str) -> dict[str, Any]:
    """What a ``save_state`` checkpoint says about its run, without its tensors: ``base_model``, ``rank`` (None:
    full fine-tuning), ``steps`` and ``user_metadata`` (empty in checkpoints saved before it was kept)."""
    state = torch.load(_state_file(root, tenant, path), map_location="cpu", weights_only=True)
    keys = ("base_model", "rank", "steps")
    return {key: state.get(key) for key in keys} | {"user_metadata": dict(state.get("user_metadata") or {})}


def read_lora(root: Path, tenant: str, request: dict[str, Any], *, alpha: float) -> LoRAConfig | None:
    """The LoRA config of the checkpoint ``request["path"]`` (to create the model it is loaded into); None: the
    checkpoint is a full fine-tuning one."""
    state = torch.load(_state_file(root, tenant, str(request.get("path", ""))), map_location="cpu", weights_only=True)
    if state["rank"] is None:
        return None
    return LoRAConfig(r=int(state["rank"]), alpha=alpha, target_modules=tuple(state["target_modules"]))


def load_state(root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]:
    path = str(request.get("path", ""))
    state = torch.load(_state_file(root, model.owner, path), map_location="cpu", weights_only=True)
    rank, targets = (None, []) if model.lora is None else (model.lora.r, list(model.lora.target_modules))
    if state["rank"] != rank or list(state["target_modules"]) != targets:
        raise UserError(
            f"checkpoint {path!r} has LoRA rank {state['rank']} on {state['target_modules']}; this model has rank "
            f"{rank} on {targets} (rank None: full fine-tuning): create the training client with the same config"
        )
    params = dict(model.module.named_parameters())
    with torch.no_grad():
        for name, value in state["adapter"].items():
            params[name].copy_(value)
    if request.get("optimizer"):
        model.optimizer.load_state_dict(state["optimizer"])
        model.steps = int(state["steps"])
    model.optimizer.zero_grad(set_to_none=True)
    return {"type": "load_weights", "path": path, "model_id": model.model_id}
