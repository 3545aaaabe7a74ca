"""Run a batch of episode groups concurrently on one rollout engine, drop crashed groups, and pack
hand the surviving trajectories to the trainer.

Every (row, sample) pair is one asyncio task; their generate calls and their rewards are batched by a
`RequestQueue` (one engine call and one reward call per round, not one per episode). An episode that raises (a tool
bug, an engine error, a reward function error) is logged and dropped together with its whole group
(a group's advantages compare its samples); the trainer counts the failures across ranks and fails
the step past ``workflow.max_failed_fraction``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from shardforge.rollout.episodes.request_queue import RequestQueue
from shardforge.rollout.episodes.trajectory import Trajectory
from shardforge.rollout.seeds import request_seed
from shardforge.rollout.types import RolloutEngine, SamplingParams
from shardforge.rollout.workflows.base import PromptRow, Workflow

__all__ = [
    "ERROR_KINDS",
    "STOP_REASONS",
    "EpisodeList",
    "episode_counts",
    "run_episodes",
]

logger = logging.getLogger(__name__)

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "exception", "timeout")
"""Tool error kinds counted in the metrics (see `shardforge.rollout.workflows.tools`)."""
STOP_REASONS = ("eos", "max_new_tokens", "correct", "answer", "max_turns", "max_tokens", "done")
"""Episode stop reasons counted in the metrics (anything else counts as ``other``)."""


class EpisodeList(list[Trajectory]):
    """The kept trajectories of one rank's batch (groups in row order) and what happened to the rest."""

    num_episodes: int = 0
    """Episodes run (kept + dropped)."""
    num_failed: int = 0
    """Episodes that raised (their groups are dropped)."""
    num_dropped: int = 0
    """Episodes dropped with a failed group (including the failed ones)."""
    first_error: str = ""
    """The first crash, for the error message when the step fails."""
    generate_calls: int = 0
    """Batched engine calls the episodes needed."""
    reward_calls: int = 0
    """Batched reward calls the episodes' ``await score_in_batch(...)`` needed (one per reward round)."""


def run_episodes(
    workflow: Workflow,
    engine: RolloutEngine,
    rows: Sequence[PromptRow],
    group_size: int,
    params: SamplingParams,
    *,
    drop_failed: bool = True,
) -> EpisodeList:
    """Run ``group_size`` episodes per row concurrently (``params.n`` must be 1); trajectories come back grouped by
    row, in sample order. Episode ``j`` of row ``g`` samples from its own seed: ``row.seed + j``, or without row
    seeds ``request_seed(params.seed, g, group_size) + j`` (what ``generate(prompts, n=group_size)`` with that seed
    gives row ``g``'s samples); unseeded when neither is set. ``drop_failed=False``: the first crashed episode's
    exception is raised (nothing is dropped)."""
    return asyncio.run(_run(workflow, engine, rows, group_size, params, drop_failed))


async def _run(
    workflow: Workflow,
    engine: RolloutEngine,
    rows: Sequence[PromptRow],
    group_size: int,
    params: SamplingParams,
    drop_failed: bool,
) -> EpisodeList:
    queue = RequestQueue(engine, params, _episode_seeds(rows, group_size, params))
    ids = list(range(len(rows) * group_size))
    queue.reserve(ids)

    async def episode(index: int) -> list[Trajectory]:
        row = rows[index // group_size]
        async with queue.episode(index, row.images) as handle:
            trajectories = await workflow.run_episode(handle, row)
        for t in trajectories:  # a user workflow may build its trajectories without `new_trajectory`
            t.images = row.images
        return trajectories

    results = await asyncio.gather(*(episode(i) for i in ids), return_exceptions=True)
    kept = EpisodeList()
    kept.num_episodes, kept.generate_calls, kept.reward_calls = len(ids), queue.generate_calls, queue.reward_calls
    for g in range(len(rows)):
        group = results[g * group_size : (g + 1) * group_size]
        errors: list[BaseException] = [r for r in group if isinstance(r, BaseException)]
        errors += [
            ValueError(f"the workflow returned {len(r)} trajectories for one episode; GRPO needs exactly 1")
            for r in group
            if not isinstance(r, BaseException) and len(r) != 1
        ]
        for error in errors:
            if not isinstance(error, Exception) or not drop_failed:
                raise error
        if errors:
            kept.num_failed += len(errors)
            kept.num_dropped += group_size
            message = f"{type(errors[0]).__name__}: {errors[0]}"
            kept.first_error = kept.first_error or message
            logger.warning(
                "dropped the group of prompt %r: %d episode(s) failed; first: %s", rows[g].prompt, len(errors), message
            )
            continue
        kept += [r[0] for r in group if not isinstance(r, BaseException)]
    return kept


def _episode_seeds(rows: Sequence[PromptRow], group_size: int, params: SamplingParams) -> list[int] | None:
    seeds = [row.seed for row in rows]
    if params.seed is not None:
        seeds = [request_seed(params.seed, g, group_size) if s is None else s for g, s in enumerate(seeds)]
    elif any(s is None for s in seeds):
        if any(s is not None for s in seeds):
            raise ValueError("some PromptRows carry a seed and others do not, with SamplingParams.seed=None: seed all")
        return None
    return [s + j for s in seeds for j in range(group_size)]  # type: ignore[operator]


def episode_counts(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Local sums for the metrics (fixed keys, so ranks can all-reduce them in one call)."""
    counts = {"episodes": float(len(trajectories)), "turns": 0.0, "tool_calls": 0.0, "generated_tokens": 0.0}
    counts |= {f"tool_errors/{kind}": 0.0 for kind in ERROR_KINDS}
    counts |= {f"stop/{reason}": 0.0 for reason in (*STOP_REASONS, "other")}
    for t in trajectories:
        counts["turns"] += len(t.turns)
        counts["tool_calls"] += t.tool_calls
        counts["generated_tokens"] += t.num_generated
        for kind in t.tool_errors:
            key = f"tool_errors/{kind}"
            counts[key if key in counts else "tool_errors/exception"] += 1
        reason = f"stop/{t.stop_reason}"
        counts[reason if reason in counts else "stop/other"] += 1
    return counts
