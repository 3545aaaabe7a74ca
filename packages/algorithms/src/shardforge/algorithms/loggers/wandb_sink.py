"""``loggers: [wandb]``: metrics, run config and artifacts through the ``wandb`` package.

Runs are written under ``output_dir/wandb`` (wandb's run directories; ``WANDB_DIR`` wins). The run
id is kept in ``output_dir/trackers.json``; a resumed run continues it (``resume="allow"``). With
``WANDB_MODE=offline`` (or ``tracker.wandb_mode: offline``) nothing leaves the machine; upload
later with ``wandb sync output_dir/wandb/offline-run-*``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, cast

from shardforge.algorithms.loggers.tracking import (
    load_run_id,
    numeric,
    run_params,
    save_run_id,
    tracker_options,
)

__all__ = ["WandbLogger", "wandb_logger"]

logger = logging.getLogger(__name__)

PIP_HINT = "pip install 'shardforge-algorithms[trackers]' (or: pip install wandb)"


class WandbLogger:
    """One W&B run per output_dir (continued on resume); metrics as ``<split>/<name>`` at ``step``."""

    def __init__(self, out_dir: Path, run_config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(f"wandb is not installed: {PIP_HINT}") from exc
        self.wandb = wandb
        self.out_dir = Path(out_dir)
        self.run_config = run_config
        self.options = tracker_options(run_config)
        self.run: Any = None

    def begin(self, start_step: int, run_info: dict[str, Any], *, logged_until: int | None = None) -> None:
        """Start the run, or continue the stored one when resuming (``start_step`` > 0). When the
        interrupted run logged steps past ``start_step`` (``logged_until``), the run is rewound
        to ``start_step`` (``resume_from="<id>?_step=<start_step>"``): W&B keeps the history up to and
        including that step and drops the rest, so the resumed steps replace the stale ones instead of
        being refused as non-monotonic."""
        stored = load_run_id(self.out_dir, "wandb", start_step)
        rewind = stored is not None and logged_until is not None and logged_until > start_step
        resume: dict[str, Any] = {}
        if rewind:
            assert stored is not None
            resume = {"resume_from": f"{stored['id']}?_step={start_step}"}
        elif stored:
            resume = {"id": stored["id"], "resume": "allow"}
        run_dir = Path(os.environ.get("WANDB_DIR") or self.out_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        params = run_params(self.run_config, run_info)
        config = {"config": self.run_config, **{k: v for k, v in params.items() if not k.startswith("config.")}}
        self.run = self.wandb.init(
            project=self.options.project,
            entity=self.options.wandb_entity,
            name=self.options.run_name or self.out_dir.name,
            tags=list(self.options.tags),
            mode=cast(Any, self.options.wandb_mode),  # checked by TrackerConfig
            dir=str(run_dir),
            config=config,
            allow_val_change=bool(stored),
            settings=self.wandb.Settings(console="off", silent=True),
            **resume,
        )
        save_run_id(self.out_dir, "wandb", {"id": self.run.id, "project": self.options.project})
        logger.info("wandb run %s (%s)", self.run.id, self.run.dir)

    def log(self, step: int, values: dict[str, float], split: str) -> None:
        assert self.run is not None, "begin() was not called"
        self.run.log({f"{split}/{key}": value for key, value in numeric(values).items()}, step=step)

    def finish(self, summary: dict[str, Any], artifacts: dict[str, Path]) -> None:
        """Final metrics into the run summary (``final/<name>``); with ``tracker.log_artifacts`` one
        ``model`` artifact holding the files in ``artifacts``."""
        assert self.run is not None, "begin() was not called"
        self.run.summary.update({f"final/{key}": value for key, value in numeric(summary).items()})
        present = {name: path for name, path in artifacts.items() if path.exists()}
        if not self.options.log_artifacts or not present:
            return
        artifact = self.wandb.Artifact(f"{self.run.name or self.run.id}-output".replace("/", "-"), type="model")
        for name, path in present.items():
            if path.is_dir():
                artifact.add_dir(str(path), name=name)
            else:
                artifact.add_file(str(path), name=path.name)
        self.run.log_artifact(artifact)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def wandb_logger(out_dir: Path, run_config: dict[str, Any]) -> WandbLogger:
    """The `LOGGERS` factory for ``wandb``."""
    return WandbLogger(out_dir, run_config)
