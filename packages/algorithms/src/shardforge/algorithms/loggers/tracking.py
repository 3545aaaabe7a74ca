"""Shared parts of the experiment-tracker sinks (wandb, mlflow): their options (`TrackerConfig`,
the ``tracker:`` config key), the run parameters every tracker records (config, layout, package
versions, git revision), and ``output_dir/trackers.json``, where each tracker keeps its run id so a
resumed run continues the same tracker run."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["TRACKERS_FILE", "TrackerConfig", "load_run_id", "numeric", "run_params", "save_run_id", "tracker_options"]

TRACKERS_FILE = "trackers.json"
_VERSIONS = ("torch", "transformers", "shardforge-algorithms", "wandb", "mlflow-skinny", "mlflow")


@dataclass(frozen=True, kw_only=True)
class TrackerConfig:
    """Options of the ``wandb`` and ``mlflow`` loggers (used only when ``loggers`` names them)."""

    project: str = "shardforge"
    """W&B project and MLflow experiment name."""
    run_name: str | None = None
    """Display name of the run (default: the output_dir's name)."""
    tags: tuple[str, ...] = ()
    """Tags on the run (W&B tags; MLflow tags with an empty value)."""
    wandb_entity: str | None = None
    """W&B entity (team or user); default: your W&B default entity."""
    wandb_mode: str | None = None
    """W&B mode: online, offline or disabled (default: WANDB_MODE, else wandb's own default)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (default: MLFLOW_TRACKING_URI, else sqlite:///<output_dir>/mlflow.db)."""
    log_artifacts: bool = True
    """At the end, upload the HF export (hf/, lora/) and summary.json as artifacts."""

    def __post_init__(self) -> None:
        modes = ("online", "offline", "disabled")
        if self.wandb_mode is not None and self.wandb_mode not in modes:
            raise ValueError(f"tracker.wandb_mode={self.wandb_mode!r} is invalid; use one of {modes} or leave it unset")


def tracker_options(run_config: dict[str, Any]) -> TrackerConfig:
    """The ``tracker`` section of a run's config dict (defaults when absent)."""
    raw = dict(run_config.get("tracker") or {})
    raw["tags"] = tuple(raw.get("tags") or ())
    return TrackerConfig(**raw)


def _flatten(value: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)


def git_revision(cwd: Path | None = None) -> str | None:
    """``git rev-parse HEAD`` of the working directory (None outside a repository or without git)."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def run_params(run_config: dict[str, Any], run_info: dict[str, Any]) -> dict[str, str]:
    """Flat string parameters: ``config.<dotted key>``, the run info (layout, world size),
    ``version.<package>`` and ``git.revision`` (when the working directory is a git checkout)."""
    params: dict[str, str] = {}
    _flatten(run_config, "config", params)
    for key, value in run_info.items():
        params[key] = str(value)
    params["version.python"] = sys.version.split()[0]
    for name in _VERSIONS:
        try:
            params[f"version.{name}"] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    revision = git_revision()
    if revision:
        params["git.revision"] = revision
    return params


def numeric(values: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of ``values`` (bools and strings left out), as floats."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def load_run_id(out_dir: Path, tracker: str, start_step: int) -> dict[str, Any] | None:
    """The stored run of ``tracker`` when resuming (``start_step`` > 0); None for a fresh start."""
    path = Path(out_dir) / TRACKERS_FILE
    if start_step <= 0 or not path.is_file():
        return None
    entry = json.loads(path.read_text()).get(tracker)
    return dict(entry) if isinstance(entry, dict) else None


def save_run_id(out_dir: Path, tracker: str, entry: dict[str, Any]) -> None:
    """Record ``tracker``'s run in ``output_dir/trackers.json`` (other trackers' entries kept)."""
    path = Path(out_dir) / TRACKERS_FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[tracker] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
