"""``loggers: [mlflow]``: metrics, run parameters and artifacts through MLflow's own client.

The tracking store is ``tracker.mlflow_tracking_uri``, else ``MLFLOW_TRACKING_URI``, else
``sqlite:///<output_dir>/mlflow.db`` (MLflow's recommended local store; its ``./mlruns`` file store
is in maintenance mode and refuses to start unless ``MLFLOW_ALLOW_FILE_STORE=true``). With that
default the artifacts go to ``<output_dir>/mlartifacts``. The run id is kept in
``output_dir/trackers.json``; a resumed run logs into the same MLflow run.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from shardforge.algorithms.loggers.tracking import (
    load_run_id,
    numeric,
    run_params,
    save_run_id,
    tracker_options,
)

__all__ = ["MlflowLogger", "mlflow_logger"]

logger = logging.getLogger(__name__)

PIP_HINT = "pip install 'shardforge-algorithms[trackers]' (or: pip install mlflow-skinny sqlalchemy alembic)"
_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit
_MAX_PARAM = 6000  # MLflow's longest parameter value
_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
FLUSH_SECONDS = 10.0
"""Metrics are buffered and written at most this often (and at finish/close): one store write per
step costs ~6 ms with the sqlite store, 2.8% of a demo SFT step (benchmarks/bench_loggers.py)."""


class MlflowLogger:
    """One MLflow run per output_dir (continued on resume); metrics as ``<split>/<name>``."""

    def __init__(self, out_dir: Path, run_config: dict[str, Any]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(f"mlflow is not installed: {PIP_HINT}") from exc
        self.out_dir = Path(out_dir)
        self.run_config = run_config
        self.options = tracker_options(run_config)
        default_uri = f"sqlite:///{(self.out_dir / 'mlflow.db').resolve()}"
        self.tracking_uri = self.options.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri
        self._default_store = self.tracking_uri == default_uri
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id: str | None = None
        self._pending: list[Any] = []
        self._flushed_at = time.monotonic()

    def begin(self, start_step: int, run_info: dict[str, Any], *, logged_until: int | None = None) -> None:
        """Start the run, or continue the stored one when resuming (``start_step`` > 0). MLflow cannot
        delete logged metric points: when the interrupted run logged steps past ``start_step``
        (``logged_until``), the run gets the tag ``shardforge.stale_steps`` = ``"<first>-<last>"``; for
        those steps the points logged after the resume (the later timestamps) are the run's."""
        from mlflow.entities import Param

        stored = load_run_id(self.out_dir, "mlflow", start_step)
        params = {k[:250]: v[:_MAX_PARAM] for k, v in run_params(self.run_config, run_info).items()}
        if stored and stored.get("tracking_uri") == self.tracking_uri:
            self.run_id = str(stored["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
            known = self.client.get_run(self.run_id).data.params
            # Parameters are immutable in MLflow: a value that changed on resume (e.g. steps) becomes a tag.
            for key, value in params.items():
                if key in known and known[key] != value:
                    self.client.set_tag(self.run_id, f"resumed_at_{start_step}.{key}", value)
            params = {k: v for k, v in params.items() if k not in known}
            self.client.set_tag(self.run_id, "shardforge.resumed_from", str(start_step))
            if logged_until is not None and logged_until > start_step:
                self.client.set_tag(self.run_id, "shardforge.stale_steps", f"{start_step + 1}-{logged_until}")
        else:
            experiment = self.client.get_experiment_by_name(self.options.project)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                location = (self.out_dir / "mlartifacts").resolve().as_uri() if self._default_store else None
                experiment_id = self.client.create_experiment(self.options.project, artifact_location=location)
            tags = {tag: "" for tag in self.options.tags}
            run = self.client.create_run(experiment_id, run_name=self.options.run_name or self.out_dir.name, tags=tags)
            self.run_id = run.info.run_id
            save_run_id(self.out_dir, "mlflow", {"run_id": self.run_id, "tracking_uri": self.tracking_uri})
        items = [Param(k, v) for k, v in params.items()]
        for first in range(0, len(items), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[first : first + _PARAMS_PER_BATCH])
        logger.info("mlflow run %s (%s)", self.run_id, self.tracking_uri)

    def log(self, step: int, values: dict[str, float], split: str) -> None:
        from mlflow.entities import Metric

        assert self.run_id is not None, "begin() was not called"
        now = int(time.time() * 1000)
        self._pending += [Metric(f"{split}/{key}", value, now, step) for key, value in numeric(values).items()]
        if time.monotonic() - self._flushed_at >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write the buffered metrics."""
        pending, self._pending = self._pending, []
        self._flushed_at = time.monotonic()
        for first in range(0, len(pending), _METRICS_PER_BATCH):
            self.client.log_batch(str(self.run_id), metrics=pending[first : first + _METRICS_PER_BATCH])

    def finish(self, summary: dict[str, Any], artifacts: dict[str, Path]) -> None:
        """Final metrics (``final/<name>``) and, with ``tracker.log_artifacts``, the files in ``artifacts``."""
        from mlflow.entities import Metric

        assert self.run_id is not None, "begin() was not called"
        now, step = int(time.time() * 1000), int(summary.get("steps", 0))
        self._pending += [Metric(f"final/{key}", value, now, step) for key, value in numeric(summary).items()]
        self.flush()
        if not self.options.log_artifacts:
            return
        for name, path in artifacts.items():
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=name)
            elif path.is_file():
                self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        if self.run_id is not None:
            self.flush()
            self.client.set_terminated(self.run_id)
            self.run_id = None


def mlflow_logger(out_dir: Path, run_config: dict[str, Any]) -> MlflowLogger:
    """The `LOGGERS` factory for ``mlflow``."""
    return MlflowLogger(out_dir, run_config)
