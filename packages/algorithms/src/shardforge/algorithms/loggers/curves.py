"""``curves.png`` at the end of every run: training loss, and eval metrics / rewards when present."""

from __future__ import annotations

import logging
from pathlib import Path

from shardforge.algorithms.loggers.jsonl import read_metrics

__all__ = ["write_curves"]

logger = logging.getLogger(__name__)

_SECOND_PANEL = (("train", "reward_mean", "train reward (mean)"), ("eval", "accuracy", "held-out accuracy"))


def write_curves(metrics_file: str | Path, png: str | Path, title: str = "") -> Path | None:
    """Plot ``metrics_file`` into ``png``; None (logged once) when matplotlib is missing or it fails.

    Never raises: a plot is a convenience and must not fail a finished run.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: no %s (pip install matplotlib)", Path(png).name)
        return None
    try:
        train = read_metrics(metrics_file, "train")
        evaluation = read_metrics(metrics_file, "eval")
        second = [(split, key, label) for split, key, label in _SECOND_PANEL
                  if any(key in r for r in (train if split == "train" else evaluation))]  # fmt: skip
        fig, axes = plt.subplots(1, 1 + bool(second), figsize=(6 + 5 * bool(second), 4), squeeze=False)
        ax = axes[0][0]
        ax.plot(
            [r["step"] for r in train if "loss" in r], [r["loss"] for r in train if "loss" in r], label="train loss"
        )
        if any("loss" in r for r in evaluation):
            points = [r for r in evaluation if "loss" in r]
            ax.plot([r["step"] for r in points], [r["loss"] for r in points], "o-", label="held-out loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        if second:
            ax2 = axes[0][1]
            for split, key, label in second:
                points = [r for r in (train if split == "train" else evaluation) if key in r]
                ax2.plot([r["step"] for r in points], [r[key] for r in points], "o-" if split == "eval" else "-",
                         label=label)  # fmt: skip
            ax2.set_xlabel("step")
            ax2.legend()
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
        return Path(png)
    except Exception as exc:
        logger.warning("could not write %s: %s: %s", png, type(exc).__name__, exc)
        return None
