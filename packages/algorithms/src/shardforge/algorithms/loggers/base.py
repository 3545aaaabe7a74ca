"""The one interface every metrics logger implements."""

from __future__ import annotations

from typing import Protocol

__all__ = ["MetricsSink"]


class MetricsSink(Protocol):
    """Where one rank's metric records go (`MetricsLogger` fans out to several)."""

    def log(self, step: int, values: dict[str, float], split: str) -> None:
        """Record ``values`` of ``split`` ("train", "eval", ...) at optimizer step ``step``."""

    def close(self) -> None:
        """Flush and release the sink."""
