"""``loggers: [jsonl, tensorboard, ...]``: metric sinks by name, each one unable to stop a run.

A sink factory takes ``(out_dir, run_config)`` and returns a `MetricsSink`. Register one with
``@LOGGERS.register("name")`` or name a user's factory as ``"package.module:factory"``. Every
sink is wrapped in `NeverFatal`: a sink that fails to start, log or close is reported once (with
the exception) and disabled; training goes on, and the other sinks keep logging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardforge.algorithms.loggers.base import MetricsSink
from shardforge.algorithms.loggers.jsonl import JsonlLogger
from shardforge.algorithms.loggers.tensorboard import TensorBoardLogger
from shardforge.core.registry import Registry

__all__ = ["LOGGERS", "NeverFatal", "build_sinks"]

logger = logging.getLogger(__name__)

SinkFactory = Callable[[Path, dict[str, Any]], MetricsSink]
LOGGERS: Registry[SinkFactory] = Registry("metrics logger")


@LOGGERS.register("jsonl")
def _jsonl(out_dir: Path, run_config: dict[str, Any]) -> MetricsSink:
    """output_dir/metrics.jsonl, one JSON object per record (resume truncates it to the checkpoint)."""
    return JsonlLogger(Path(out_dir) / "metrics.jsonl")


@LOGGERS.register("tensorboard")
def _tensorboard(out_dir: Path, run_config: dict[str, Any]) -> MetricsSink:
    """output_dir/tensorboard, scalars as <split>/<name> (a no-op without tensorboard installed)."""
    return TensorBoardLogger(Path(out_dir) / "tensorboard")


LOGGERS.register_lazy(
    "wandb",
    "shardforge.algorithms.loggers.wandb_sink:wandb_logger",
    "Weights & Biases run under output_dir/wandb (WANDB_MODE=offline works); resumed runs continue it",
)
LOGGERS.register_lazy(
    "mlflow",
    "shardforge.algorithms.loggers.mlflow_sink:mlflow_logger",
    "MLflow run (default store sqlite:///<output_dir>/mlflow.db); resumed runs continue it",
)


class NeverFatal:
    """Wraps a sink: its first exception is logged once and the sink is disabled from then on."""

    def __init__(self, name: str, sink: MetricsSink | None) -> None:
        self.name = name
        self.sink = sink

    def _fail(self, what: str, exc: BaseException) -> None:
        logger.warning(
            "metrics logger %r failed to %s (%s: %s); it is disabled for the rest of the run, training goes on",
            self.name,
            what,
            type(exc).__name__,
            exc,
        )
        self.sink = None

    def log(self, step: int, values: dict[str, float], split: str) -> None:
        if self.sink is None:
            return
        try:
            self.sink.log(step, values, split)
        except Exception as exc:
            self._fail("log", exc)

    def begin(self, start_step: int, run_info: dict[str, Any], *, logged_until: int | None = None) -> None:
        """Open the sink's run (optional hook ``begin(start_step, run_info[, logged_until=])``: trackers
        start or continue their run here; ``logged_until`` is passed only when a resumed run finds steps
        past ``start_step`` logged by the interrupted one)."""
        hook = getattr(self.sink, "begin", None)
        if hook is None:
            return
        try:
            stale = logged_until is not None and logged_until > start_step
            hook(start_step, run_info, logged_until=logged_until) if stale else hook(start_step, run_info)
        except Exception as exc:
            self._fail("start", exc)

    def finish(self, summary: dict[str, Any], artifacts: dict[str, Path]) -> None:
        """Final metrics and artifacts of a finished run (optional hook)."""
        hook = getattr(self.sink, "finish", None)
        if hook is None:
            return
        try:
            hook(summary, artifacts)
        except Exception as exc:
            self._fail("log final metrics/artifacts", exc)

    def close(self) -> None:
        if self.sink is None:
            return
        try:
            self.sink.close()
        except Exception as exc:
            self._fail("close", exc)


def build_sinks(names: tuple[str, ...] | list[str], out_dir: Path, run_config: dict[str, Any]) -> list[NeverFatal]:
    """One `NeverFatal` sink per name; an unknown name is a config error (raised), a sink that fails
    to start is reported and left out."""
    factories = [(name, LOGGERS.get(name)) for name in names]  # unknown names fail here, before training
    sinks = []
    for name, factory in factories:
        wrapped = NeverFatal(name, None)
        try:
            wrapped.sink = factory(Path(out_dir), run_config)
        except Exception as exc:
            wrapped._fail("start", exc)
            continue
        sinks.append(wrapped)
    return sinks
