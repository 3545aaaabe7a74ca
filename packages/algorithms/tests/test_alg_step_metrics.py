"""`StepMetrics` and `reduce_stats_once`: a step's statistics reduced by name (sums, ``*_max``, ``*_min``) in one
collective, the same on every rank, whatever the stage."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.algorithms.trainers.rl.metrics import StepMetrics, means_of
from shardforge.mesh.testing import get_rank_pool


def _on_rank(_: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms.testing.collective_check import CollectiveRecorder

    rank = dist.get_rank()
    metrics = StepMetrics()
    metrics.add("tokens", {"loss": 2.0 * (rank + 1), "num_tokens": 2 + rank, "ratio_max": 1.5 - rank})
    metrics.add("extremes", {"low_min": float(rank), "count": 1}, lambda raw: {"lowest": raw["low_min"]})
    metrics.add("means", {"a": 3.0 * rank, "num_rows": 3}, means_of("num_rows", prefix="m/"))
    metrics.put({"version": 7.0})
    with CollectiveRecorder() as recorder:
        out = metrics.reduce(dist.group.WORLD, torch.device("cpu"))
    return {"out": out, "collectives": [c.op for c in recorder.calls]}


def test_one_collective_reduces_sums_and_extremes_the_same_on_every_rank() -> None:
    results = get_rank_pool(2).run(_on_rank, None, timeout_s=60)
    expected = {"loss": 6.0, "num_tokens": 5.0, "ratio_max": 1.5, "lowest": 0.0, "m/a": 0.5, "version": 7.0}
    for result in results:
        assert result["collectives"] == ["all_gather"], result["collectives"]
        assert result["out"] == pytest.approx(expected), result["out"]
    assert results[0]["out"] == results[1]["out"]  # bit for bit: every rank sums in rank order


def test_without_a_group_the_local_values_are_the_metrics() -> None:
    metrics = StepMetrics()
    metrics.add("reward", {"sum": torch.tensor(3.0), "count": 2}, lambda raw: {"mean": raw["sum"] / raw["count"]})
    assert metrics.reduce(None) == {"mean": 1.5}
    with pytest.raises(ValueError, match="stage 'reward' was already added"):
        metrics.add("reward", {"sum": 1.0})


def test_sums_only_are_one_all_reduce() -> None:
    def sums(_: Any) -> list[str]:
        import torch.distributed as dist

        from shardforge.algorithms.testing.collective_check import CollectiveRecorder

        metrics = StepMetrics()
        metrics.add("a", {"x": 1.0, "y": float(dist.get_rank())})
        with CollectiveRecorder() as recorder:
            assert metrics.reduce(dist.group.WORLD, torch.device("cpu")) == {"x": 2.0, "y": 1.0}
        return [c.op for c in recorder.calls]

    assert get_rank_pool(2).run(sums, None, timeout_s=60) == [["all_reduce"], ["all_reduce"]]
