"""`StepMetrics`: a step's statistics, reduced over the data-parallel group ONCE, at the end of the step (STYLE 19).

Each stage of an RL step adds its raw local statistics (sums and counts; extremes named ``*_max`` / ``*_min``, as
everywhere in shardforge: the name says how a value reduces) together with the function that turns the reduced
values into metrics. `reduce` packs every stage's values into one collective (`shardforge.mesh.collectives.
reduce_stats_once`) and applies the functions. Values that need no reduction (this rank's timings, the served
version, a coefficient every rank holds) go in with `put`. No stage needs the engine or a process group, and a step
makes one metrics collective instead of one per helper.

Every rank must add the same names (a stage that has nothing to report on one rank still adds its zeros).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from shardforge.mesh.collectives import reduce_stats_once

__all__ = ["MetricsView", "StepMetrics", "means_of"]

MetricsView = Callable[[dict[str, float]], dict[str, float]]
"""Reduced raw statistics of one stage -> its metrics."""


def means_of(per: str, *, prefix: str = "", keep: tuple[str, ...] = ()) -> MetricsView:
    """A view that divides every value by the count ``per`` (0.0 when it is 0) and names it ``prefix + name``;
    ``keep`` and extremes (``*_max`` / ``*_min``) are reported as they are, ``per`` itself is dropped."""

    def view(raw: dict[str, float]) -> dict[str, float]:
        count = raw.get(per, 0.0)
        out = {}
        for name, value in raw.items():
            if name == per:
                continue
            plain = name in keep or name.endswith(("_max", "_min"))
            out[prefix + name] = value if plain else (value / count if count else 0.0)
        return out

    return view


class StepMetrics:
    """The statistics of one step (see the module docstring)."""

    def __init__(self) -> None:
        self._raw: dict[str, float] = {}
        self._views: list[tuple[str, tuple[str, ...], MetricsView | None]] = []
        self._plain: dict[str, float] = {}

    def add(self, stage: str, raw: Mapping[str, torch.Tensor | float | int], view: MetricsView | None = None) -> None:
        """Add ``stage``'s raw local statistics; ``view`` turns their reduced values into metrics (None: the reduced
        values are the metrics). A stage is added once per step."""
        if any(name == stage for name, _, _ in self._views):
            raise ValueError(f"stage {stage!r} was already added to this step's metrics")
        keys = tuple(sorted(raw))
        for key in keys:
            self._raw[f"{stage}\0{key}"] = float(raw[key])
        self._views.append((stage, keys, view))

    def put(self, metrics: Mapping[str, float]) -> None:
        """Metrics that need no reduction (this rank's timings, values every rank holds)."""
        self._plain.update({k: float(v) for k, v in metrics.items()})

    def reduce(self, group: dist.ProcessGroup | None, device: torch.device | None = None) -> dict[str, float]:
        """Every stage's metrics after ONE collective over ``group`` (none without a group), then the `put` ones."""
        reduced = reduce_stats_once(self._raw, group, device)
        out: dict[str, float] = {}
        for stage, keys, view in self._views:
            values = {key: reduced[f"{stage}\0{key}"] for key in keys}
            out.update(view(values) if view is not None else values)
        return out | self._plain
