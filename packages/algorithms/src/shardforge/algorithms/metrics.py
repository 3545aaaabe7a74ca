"""Metrics to JSONL and TensorBoard, written by rank 0 only."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger"]


class MetricsLogger:
    """Append ``{"step": ..., "split": ..., **values}`` lines to ``metrics.jsonl`` and TensorBoard."""

    def __init__(self, out_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._tb: Any = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))
            except ImportError:  # tensorboard is optional at run time
                self._tb = None

    def log(self, step: int, values: dict[str, float], *, split: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": step, "split": split, "time": time.time(), **values}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def read_metrics(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """The records of one split from a ``metrics.jsonl``."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("split") == split:
                records.append(record)
    return records
