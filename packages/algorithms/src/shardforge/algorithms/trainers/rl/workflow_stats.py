"""The RL step's one agreement before training: failed episodes, counted over the data-parallel ranks (the
per-episode metrics are a `StepMetrics` stage: `step_stats.add_workflow_stats`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardforge.mesh.collectives import all_reduce_sum
from shardforge.rollout.episodes.trajectory import Trajectory

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    from shardforge.engine import TrainEngine

__all__ = ["check_failed_episodes"]


def check_failed_episodes(
    trajectories: Sequence[Trajectory], max_failed_fraction: float, engine: TrainEngine
) -> dict[str, float]:
    """Count crashed / dropped episodes over the data-parallel group; raise on EVERY rank (so none
    waits in a collective) when more than ``max_failed_fraction`` of the episodes crashed or a rank
    is left without a trajectory."""
    local_episodes = getattr(trajectories, "num_episodes", len(trajectories))
    failed, dropped, episodes, empty = all_reduce_sum(
        getattr(trajectories, "num_failed", 0), getattr(trajectories, "num_dropped", 0), local_episodes,
        float(len(trajectories) == 0), group=engine.dp_group, device=engine.device,
    )  # fmt: skip
    fraction = failed / max(episodes, 1.0)
    if fraction > max_failed_fraction or empty:
        first = getattr(trajectories, "first_error", "") or "(on another rank)"
        raise RuntimeError(
            f"{int(failed)} of {int(episodes)} episodes crashed this step ({fraction:.1%} > "
            f"workflow.max_failed_fraction={max_failed_fraction:g}{'; a rank has no trajectory left' if empty else ''}); "
            f"first error on this rank: {first}. Fix the workflow/tool/reward, or raise workflow.max_failed_fraction "
            "to drop crashed episodes' groups and go on"
        )
    return {"episodes_failed": failed, "episodes_dropped": dropped}
