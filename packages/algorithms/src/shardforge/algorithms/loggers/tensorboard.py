"""TensorBoard scalars ``<split>/<name>`` (optional: a no-op when tensorboard is not installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger:
    """Scalars under ``log_dir``."""

    def __init__(self, log_dir: str | Path) -> None:
        self._writer: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional at run time
            return
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, values: dict[str, float], split: str) -> None:
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
