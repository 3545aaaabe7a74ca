"""Training runs as the SDK's ``RestClient`` sees them: ``get_training_run`` / ``get_training_run_by_tinker_path``
(``GET /api/v1/training_runs/{model_id}``), which tinker-cookbook calls before it loads a checkpoint, to compare
the ``renderer_name`` kept in the run's ``user_metadata`` with its own.

A run is a live training model of this tenant or, after a service restart, the ``save_state`` checkpoints it
left on disk (the newest one says what the run was). Another tenant's run reads as unknown (404).
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from shardforge.algorithms.serve.checkpoints import list_training_checkpoints, read_checkpoint_info
from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.models import ModelRegistry

__all__ = ["check_user_metadata", "training_run"]


def check_user_metadata(value: Any) -> dict[str, str]:
    """A request's ``user_metadata`` (absent: empty); UserError unless it maps strings to strings."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise UserError(f"user_metadata must be an object of strings to strings, got {value!r}")
    return dict(value)


def training_run(root: Path, registry: ModelRegistry, tenant: str, model_id: str) -> dict[str, Any]:
    """The SDK's ``TrainingRun`` JSON for ``model_id``; KeyError (404) when it is not a run of ``tenant``."""
    checkpoints = list_training_checkpoints(root, tenant, model_id)
    live = registry.models.get(model_id)
    if live is not None and live.owner == tenant:
        rank = None if live.lora is None else live.lora.r
        base_model, metadata, times = live.base_model, live.user_metadata, [live.created]
    elif checkpoints:
        info = read_checkpoint_info(root, tenant, checkpoints[-1]["tinker_path"])
        base_model, rank, metadata, times = info["base_model"], info["rank"], info["user_metadata"], []
    else:
        raise KeyError(f"training run {model_id!r} is not a model of this API key")
    prefix = f"tinker://{model_id}/sampler_weights/"
    samplers = [
        {"checkpoint_id": path.removeprefix(f"tinker://{model_id}/"), "checkpoint_type": "sampler",
         "time": weights.created, "tinker_path": path}
        for path, weights in list(registry.samplers.items())
        if weights.owner == tenant and path.startswith(prefix) and weights.created
    ]  # fmt: skip
    last_sampler = max(samplers, key=lambda c: c["time"], default=None)
    times += [c["time"] for c in checkpoints] + [c["time"] for c in samplers]
    return {
        "training_run_id": model_id, "base_model": base_model, "model_owner": tenant, "is_lora": rank is not None,
        "lora_rank": rank, "corrupted": False,
        # the newest thing the service knows of the run: its creation, its checkpoints (no per-request clock)
        "last_request_time": max((t for t in times if t), default=datetime.datetime.now(datetime.UTC).isoformat()),
        "last_checkpoint": checkpoints[-1] if checkpoints else None, "last_sampler_checkpoint": last_sampler,
        "user_metadata": metadata or None,
    }  # fmt: skip
