"""Metrics loggers behind one interface (`MetricsSink`), selected by name (`LOGGERS`: jsonl,
tensorboard, wandb, mlflow, or a user's ``package.module:factory``), written by the main rank only, never fatal.
`MetricsLogger` is what trainers hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardforge.algorithms.loggers.base import MetricsSink
from shardforge.algorithms.loggers.curves import write_curves
from shardforge.algorithms.loggers.jsonl import JsonlLogger, read_metrics, truncate_metrics
from shardforge.algorithms.loggers.registry import LOGGERS, NeverFatal, build_sinks
from shardforge.algorithms.loggers.tensorboard import TensorBoardLogger
from shardforge.algorithms.loggers.tracking import TrackerConfig

__all__ = [
    "LOGGERS",
    "JsonlLogger",
    "MetricsLogger",
    "MetricsSink",
    "NeverFatal",
    "TensorBoardLogger",
    "TrackerConfig",
    "read_metrics",
    "truncate_metrics",
    "write_curves",
]


class MetricsLogger:
    """``out_dir/metrics.jsonl`` and ``out_dir/tensorboard`` (or any ``sinks``); nothing when disabled."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        sinks: list[MetricsSink] | None = None,
        names: tuple[str, ...] | list[str] | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        """``names`` (the ``loggers`` config key) picks sinks from `LOGGERS`, each wrapped in
        `NeverFatal`; without it, jsonl (+ tensorboard)."""
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.sinks: list[MetricsSink] = []
        if not enabled:
            return
        if sinks is not None:
            self.sinks = list(sinks)
            return
        if names is None:
            names = ("jsonl", "tensorboard") if tensorboard else ("jsonl",)
        self.sinks = list(build_sinks(names, Path(out_dir), run_config or {}))

    def begin(self, start_step: int, run_info: dict[str, Any], *, logged_until: int | None = None) -> None:
        """Start (``start_step`` 0) or continue (resume) the trackers' runs; ``run_info`` (layout, world
        size) is recorded with the config as run parameters. ``logged_until``: the last step the
        interrupted run logged (from `truncate_metrics`); steps after ``start_step`` up to it are stale
        and the trackers drop or mark them."""
        for sink in self.sinks:
            if isinstance(sink, NeverFatal):
                sink.begin(start_step, run_info, logged_until=logged_until)

    def finish(self, summary: dict[str, Any], artifacts: dict[str, Path]) -> None:
        """Final metrics (``summary``) and artifact files/directories, for the sinks that take them."""
        for sink in self.sinks:
            if isinstance(sink, NeverFatal):
                sink.finish(summary, artifacts)

    def log(self, step: int, values: dict[str, float], *, split: str = "train") -> None:
        for sink in self.sinks:
            sink.log(step, values, split)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []  # closing twice is a no-op
