"""Metrics loggers behind one interface (`MetricsSink`): JSONL and TensorBoard, written by the
main rank only. `MetricsLogger` is what trainers hold."""

from __future__ import annotations

from pathlib import Path

from shardforge.algorithms.loggers.base import MetricsSink
from shardforge.algorithms.loggers.curves import write_curves
from shardforge.algorithms.loggers.jsonl import JsonlLogger, read_metrics, truncate_metrics
from shardforge.algorithms.loggers.tensorboard import TensorBoardLogger

__all__ = [
    "JsonlLogger",
    "MetricsLogger",
    "MetricsSink",
    "TensorBoardLogger",
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
    ) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.sinks: list[MetricsSink] = []
        if not enabled:
            return
        if sinks is not None:
            self.sinks = list(sinks)
            return
        self.sinks.append(JsonlLogger(self.path))
        if tensorboard:
            self.sinks.append(TensorBoardLogger(Path(out_dir) / "tensorboard"))

    def log(self, step: int, values: dict[str, float], *, split: str = "train") -> None:
        for sink in self.sinks:
            sink.log(step, values, split)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
