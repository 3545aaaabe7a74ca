"""Held-out evaluation through a workflow (``workflow.name``: multi_turn, tool_use or a user's).

Every held-out prompt runs one greedy episode (temperature 0) and, with ``eval_sampling.samples = n``,
n sampled episodes, with the workflow the trainer uses. Reported (means over the held-out prompts):

    accuracy, success@1       greedy episodes whose reward >= correct_threshold (the same number)
    reward_mean               the greedy episodes' reward
    avg@n, pass@k             sampled episodes: mean success and the unbiased pass@k estimate
    turns_mean                model turns per greedy episode
    tool_calls_mean           tool calls per greedy episode
    tool_errors_mean          failed tool calls per greedy episode (tool_errors/<kind>: their counts)
    tool_call_valid_rate      1 - failed / all tool calls of the greedy episodes (only if there were any)
    reward_per_turn           mean over greedy episodes of reward / turns
    stop/<reason>             fraction of greedy episodes that ended so (answer, correct, max_turns, ...)
    response_len_mean         generated tokens per greedy episode (all turns)
    episodes_failed           greedy + sampled episodes that raised (scored 0, logged; never a crash)

Prompts are split over the data-parallel ranks; sums are reduced once, as in `rl_eval.evaluate_prompts`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardforge.algorithms.trainers.rl.eval import (
    EvalSamplingConfig,
    evaluate_prompts,
    held_out_totals,
    sampled_metrics,
    sampled_sums,
)
from shardforge.rollout import RolloutEngine, SamplingParams
from shardforge.rollout.episodes.request_queue import EpisodeHandle
from shardforge.rollout.episodes.trajectory import Trajectory
from shardforge.rollout.seeds import request_seed
from shardforge.rollout.types import PromptSet
from shardforge.rollout.workflows import PromptRow, Workflow, WorkflowConfig, episode_counts, run_episodes

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    from shardforge.engine import TrainEngine

__all__ = ["evaluate_held_out", "evaluate_workflow"]

logger = logging.getLogger(__name__)

FAILED = "failed"
"""Stop reason of an episode that raised during evaluation."""


class _ScoredZeroOnError:
    """A workflow whose crashed episodes come back as one empty, zero-reward trajectory (counted)."""

    def __init__(self, workflow: Workflow) -> None:
        self.workflow, self.first_error = workflow, ""

    async def run_episode(self, engine: EpisodeHandle, row: PromptRow) -> list[Trajectory]:
        try:
            trajectories = await self.workflow.run_episode(engine, row)
            if len(trajectories) != 1:
                raise ValueError(f"the workflow returned {len(trajectories)} trajectories for one episode; expected 1")
            return trajectories
        except Exception as exc:
            self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"
            failed = Trajectory(group=row.index, token_ids=[], loss_mask=[], logprobs=[], versions=[])
            failed.stop_reason = FAILED
            return [failed]


def _greedy_sums(trajectories: list[Trajectory], threshold: float) -> dict[str, float]:
    counts = episode_counts(trajectories)
    sums = {k: v for k, v in counts.items() if k != "episodes"}
    sums["correct"] = float(sum(t.reward >= threshold for t in trajectories))
    sums["reward"] = float(sum(t.reward for t in trajectories))
    sums["reward_per_turn"] = float(sum(t.reward / len(t.turns) for t in trajectories if t.turns))
    sums["failed"] = float(sum(t.stop_reason == FAILED for t in trajectories))
    sums["tool_errors"] = float(sum(len(t.tool_errors) for t in trajectories))
    return sums


def evaluate_workflow(
    rollout: RolloutEngine,
    prompts: PromptSet,
    engine: TrainEngine,
    workflow: Workflow,
    sampling: EvalSamplingConfig,
    max_new_tokens: int,
    limit: int | None = None,
    *,
    runner: Callable[[Callable[[RolloutEngine], Any]], Any] | None = None,
) -> dict[str, float]:
    """The metrics listed in the module docstring for the first ``limit`` prompts (all: None).
    Collective over ``engine``'s dp group; ``runner`` runs the local episodes (see `evaluate_prompts`)."""
    count = len(prompts) if limit is None else min(limit, len(prompts))
    mine = list(range(count))[engine.dp_rank :: engine.dp_size]
    n, ks = sampling.samples, sampling.pass_k
    guarded = _ScoredZeroOnError(workflow)
    # Seeded by prompt, not by rank: every layout samples the same responses.
    rows = [
        PromptRow.from_prompts(prompts, i, index=g, seed=request_seed(sampling.seed, i, max(n, 1)))
        for g, i in enumerate(mine)
    ]

    def local(rollout_: RolloutEngine) -> dict[str, float]:
        sums = _greedy_sums([], sampling.correct_threshold) | {"sampled_len": 0.0, "sampled_failed": 0.0}
        if n:
            sums |= {f"avg@{n}": 0.0} | {f"pass@{k}": 0.0 for k in ks}
        if not rows:
            return sums
        greedy = run_episodes(guarded, rollout_, rows, 1, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))
        sums |= _greedy_sums(list(greedy), sampling.correct_threshold)
        if n:
            params = SamplingParams(
                max_new_tokens=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                seed=sampling.seed,
            )  # fmt: skip
            sampled = run_episodes(guarded, rollout_, rows, n, params)
            rewards = [[t.reward for t in sampled[g * n : (g + 1) * n]] for g in range(len(rows))]
            sums |= sampled_sums(rewards, sampling)
            sums["sampled_len"] = float(sum(t.num_generated for t in sampled))
            sums["sampled_failed"] = float(sum(t.stop_reason == FAILED for t in sampled))
        if guarded.first_error:
            logger.warning("evaluation: episodes raised (scored 0); first error: %s", guarded.first_error)
        return sums

    totals = held_out_totals(rollout, engine, local, runner)
    success = totals["correct"] / count
    result = {
        "accuracy": success,
        "success@1": success,
        "reward_mean": totals["reward"] / count,
        "turns_mean": totals["turns"] / count,
        "tool_calls_mean": totals["tool_calls"] / count,
        "tool_errors_mean": totals["tool_errors"] / count,
        "reward_per_turn": totals["reward_per_turn"] / count,
        "response_len_mean": totals["generated_tokens"] / count,
        "episodes_failed": totals["failed"] + totals["sampled_failed"],
    }
    if totals["tool_calls"]:
        result["tool_call_valid_rate"] = 1.0 - totals["tool_errors"] / totals["tool_calls"]
    result |= {k: v for k, v in totals.items() if k.startswith("tool_errors/")}
    result |= {k: v / count for k, v in totals.items() if k.startswith("stop/")}
    return result | sampled_metrics(totals, count, sampling)


def evaluate_held_out(
    rollout: RolloutEngine,
    prompts: PromptSet,
    engine: TrainEngine,
    reward_fn: Callable[[str, str, str], float],
    workflow_config: WorkflowConfig,
    workflow: Workflow | None,
    sampling: EvalSamplingConfig,
    max_new_tokens: int,
    limit: int | None = None,
    *,
    runner: Callable[[Callable[[RolloutEngine], Any]], Any] | None = None,
) -> dict[str, float]:
    """The trainers' and ``shardforge eval``'s held-out metrics: one prompt -> one response
    (`evaluate_prompts`, unchanged numbers) for the default ``workflow`` section, else episodes of
    ``workflow`` (`evaluate_workflow`)."""
    if workflow_config == WorkflowConfig() or workflow is None:
        return evaluate_prompts(
            rollout, prompts, engine, reward_fn, sampling, max_new_tokens, limit, runner=runner
        )  # fmt: skip
    return evaluate_workflow(rollout, prompts, engine, workflow, sampling, max_new_tokens, limit, runner=runner)
