"""Loss results and their statistics, kept as sums so they add up across micro-batches and ranks.

A loss function returns `LossOutput`: the micro-batch loss *sum* the engine wants, the
micro-batch weight, and statistics. Statistics are reduced by name:

- ``num_*``, ``loss_sum``, ``loss_weight``: counts and sums, added;
- ``*_max`` / ``*_min``: extremes, reduced with max / min (``-inf`` / ``inf`` when nothing was seen);
- everything else: a sum over units (target tokens for the PPO losses, pairs for the reward
  model) that `summarize_stats` divides by the count named ``per`` (``num_tokens`` by default).

So the mean over a global batch is exact whatever the micro-batching: sum the sums (also
over data-parallel ranks with `all_reduce_stats`), then `summarize_stats`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from shardforge.mesh.collectives import all_reduce_stats, stat_kind

__all__ = ["LossOutput", "all_reduce_stats", "merge_stats", "summarize_stats"]

_RAW = ("loss_sum", "loss_weight")


@dataclass(kw_only=True)
class LossOutput:
    """The result of an RL loss on one micro-batch."""

    loss_sum: torch.Tensor
    """0-dim, differentiable: what an engine ``loss_fn`` returns (sum of c_t * l_t)."""
    loss_weight: torch.Tensor
    """0-dim float64: this micro-batch's share of the global normaliser."""
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached float64 0-dim sums / counts / extremes (see the module docstring)."""

    @property
    def loss(self) -> torch.Tensor:
        """``loss_sum / loss_weight`` for this micro-batch alone; 0 (keeping the graph) when the weight is 0."""
        weight = float(self.loss_weight)
        return self.loss_sum / weight if weight > 0 else self.loss_sum * 0.0


_kind = stat_kind


def merge_stats(stats: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine the stats of several micro-batches (sums added, extremes reduced)."""
    out: dict[str, torch.Tensor] = {}
    for one in stats:
        for name, value in one.items():
            value = value.detach().double().cpu()
            if name not in out:
                out[name] = value.clone()
            elif _kind(name) == "max":
                out[name] = torch.maximum(out[name], value)
            elif _kind(name) == "min":
                out[name] = torch.minimum(out[name], value)
            else:
                out[name] = out[name] + value
    return out


def summarize_stats(stats: Mapping[str, torch.Tensor], per: str = "num_tokens") -> dict[str, float]:
    """Means and totals as plain floats.

    Plain sums are divided by ``stats[per]``; a mean over zero units and an extreme never
    observed are reported as 0.0 rather than NaN/inf. ``loss`` is added when both
    ``loss_sum`` and ``loss_weight`` are present.
    """
    if stats and per not in stats:
        raise ValueError(f"stats have no count {per!r} to divide by; available counts: {sorted(stats)}")
    count = float(stats[per]) if stats else 0.0
    out: dict[str, float] = {}
    for name, value in stats.items():
        number = float(value)
        if name.startswith("num_") or name in _RAW:
            out[name] = number
        elif _kind(name) != "sum":
            out[name] = number if torch.isfinite(torch.tensor(number)) else 0.0
        else:
            out[name] = number / count if count > 0 else 0.0
    if "loss_sum" in out and "loss_weight" in out:
        out["loss"] = out["loss_sum"] / out["loss_weight"] if out["loss_weight"] > 0 else 0.0
    return out
