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

    def begin(self, start_step: int, run_info: dict[str, Any], *, logged_until: int | None = None) -> None:
        """A resumed run hides what an interrupted one logged after ``start_step``: TensorBoard's
        ``purge_step`` discards earlier events at steps >= start_step + 1 when it reads the directory."""
        if self._writer is None or start_step <= 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self._writer.log_dir
        self._writer.close()
        self._writer = SummaryWriter(log_dir=log_dir, purge_step=start_step + 1)

    def log(self, step: int, values: dict[str, float], split: str) -> None:
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
