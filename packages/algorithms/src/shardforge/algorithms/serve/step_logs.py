"""Per-tenant training step metrics through our loggers (`shardforge.algorithms.loggers`: jsonl, tensorboard,
wandb, mlflow, or a registered factory), next to the service's ``/metrics`` counters.

A training client's step is what happens between two ``optim_step`` calls: its ``forward_backward`` calls (SDK
chunks of one call, or several calls accumulating gradients) and the ``optim_step`` that applies them. At each
``optim_step`` one row is logged for that client, at step = its optimizer step count, into
``<output_dir>/<tenant>/<model_id>/`` (``metrics.jsonl`` for jsonl):

    loss             sum of the step's forward_backward ``loss:sum`` (Tinker's losses are sums over tokens)
    tokens           model input tokens of those forward_backward calls
    datums           their datums
    forward_backward_s, optim_step_s   seconds the jobs ran (a batched job counts its whole batch's time)
    step_s           seconds from the step's first forward_backward starting to its optim_step ending
    learning_rate, grad_norm           of the optim_step

A logger that fails is logged and dropped (`NeverFatal`); it never fails a request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardforge.algorithms.loggers import MetricsLogger
from shardforge.algorithms.serve.models import TrainingModel

__all__ = ["TenantStepLogs"]


@dataclass(slots=True)
class _Step:
    loss: float = 0.0
    tokens: int = 0
    datums: int = 0
    forward_backward_s: float = 0.0
    started: float | None = None
    values: dict[str, float] = field(default_factory=dict)


class TenantStepLogs:
    """One `MetricsLogger` per training client, written at its ``optim_step`` calls (see the module doc).

    Args:
        root: the service's output directory.
        names: logger names (`shardforge.algorithms.loggers.LOGGERS`), e.g. ``("jsonl",)``.
    """

    def __init__(self, root: Path, names: tuple[str, ...]) -> None:
        self.root = root
        self.names = names
        self._loggers: dict[str, MetricsLogger] = {}
        self._steps: dict[str, _Step] = {}
        self._lock = threading.Lock()

    def _logger(self, model: TrainingModel) -> MetricsLogger:
        logger = self._loggers.get(model.model_id)
        if logger is None:
            run = {
                "tenant": model.owner, "model_id": model.model_id, "base_model": model.base_model,
                "lora_rank": None if model.lora is None else model.lora.r,
            }  # fmt: skip
            logger = MetricsLogger(self.root / model.owner / model.model_id, names=self.names, run_config=run)
            logger.begin(model.steps, run)
            self._loggers[model.model_id] = logger
        return logger

    def forward_backward(self, model: TrainingModel, tokens: int, datums: int, loss: float, started: float) -> None:
        """A ``forward_backward`` of ``model`` that started at ``started`` (perf_counter) ran and gave ``loss``."""
        with self._lock:
            step = self._steps.setdefault(model.model_id, _Step())
            step.loss += loss
            step.tokens += tokens
            step.datums += datums
            step.forward_backward_s += time.perf_counter() - started
            step.started = started if step.started is None else step.started

    def optim_step(self, model: TrainingModel, adam: dict[str, Any], result: dict[str, Any], started: float) -> None:
        """``model``'s ``optim_step`` (started at ``started``) ran: log its step's row."""
        now = time.perf_counter()
        metrics = result.get("metrics", {})
        with self._lock:
            step = self._steps.pop(model.model_id, _Step())
            values = {
                "loss": step.loss, "tokens": float(step.tokens), "datums": float(step.datums),
                "forward_backward_s": step.forward_backward_s, "optim_step_s": now - started,
                "step_s": now - (step.started if step.started is not None else started),
                "learning_rate": float(adam.get("learning_rate", 1e-4)),
                "grad_norm": float(metrics.get("grad_norm:mean", 0.0)),
            }  # fmt: skip
            logger = self._logger(model)
        logger.log(model.steps, values)

    def close(self) -> None:
        with self._lock:
            loggers, self._loggers = list(self._loggers.values()), {}
        for logger in loggers:
            logger.close()
