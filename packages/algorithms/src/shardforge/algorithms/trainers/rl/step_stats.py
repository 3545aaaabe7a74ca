"""The RL step's statistics as `StepMetrics` stages: each adds this rank's raw values and how they become metrics;
the step reduces them all in one collective at its end (`StepMetrics.reduce`).

Metric names are those the trainers always logged (``reward_mean``, ``episode/turns``, ``rollout_server/*``,
``dynamic_sampling/*``, ``partial/*``, ``stream/*``, ``actor/*``, ``rollout_corr/*``, ``behaviour_kl``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardforge.algorithms.trainers.rl.metrics import StepMetrics
from shardforge.algorithms.trainers.rl.partial_stats import STALENESS_COUNTS, staleness_metrics
from shardforge.engine.objectives import summarize_stats
from shardforge.engine.objectives.rollout_correction import summarize_correction_stats
from shardforge.rewards.guarded import GuardedReward
from shardforge.rewards.ray_pool import RayPooledReward
from shardforge.rollout.episodes.trajectory import Trajectory
from shardforge.rollout.types import ReportsStats
from shardforge.rollout.workflows.runner import episode_counts

__all__ = [
    "add_actor_stats",
    "add_behaviour_gap",
    "add_correction_stats",
    "add_dynamic_sampling_stats",
    "add_partial_rollout_stats",
    "add_reward_call_stats",
    "add_reward_stats",
    "add_rollout_server_stats",
    "add_source_stats",
    "add_stream_stats",
    "add_workflow_stats",
]


def _reward_view(raw: dict[str, float]) -> dict[str, float]:
    count = max(raw["count"], 1.0)
    mean = raw["sum"] / count
    return {
        "reward_mean": mean,
        "reward_std": max(raw["squares"] / count - mean * mean, 0.0) ** 0.5,
        "reward_positive_frac": raw["positive"] / count,
        "response_len_mean": raw["length"] / count,
    }


def add_reward_stats(metrics: StepMetrics, rewards: torch.Tensor, lengths: torch.Tensor) -> None:
    """Reward mean / std, positive fraction and mean response length over the global batch."""
    rewards = rewards.double()
    raw: dict[str, torch.Tensor | float | int] = {
        "count": rewards.numel(), "sum": rewards.sum(), "squares": (rewards**2).sum(), "length": lengths.sum(),
        "positive": (rewards > 0).sum(),
    }  # fmt: skip
    metrics.add("reward", raw, _reward_view)


def _reward_call_view(raw: dict[str, float]) -> dict[str, float]:
    scored = raw.pop("reward/terms_scored", None)  # rewards: per-term sums -> per-term means
    if scored is None:
        return raw
    return {(k[: -len("_sum")] + "_mean" if k.endswith("_sum") else k): (v / max(scored, 1.0) if k.endswith("_sum") else v)
            for k, v in raw.items()}  # fmt: skip


def add_counts(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Key-wise sum of two count dicts."""
    return {key: a.get(key, 0.0) + b.get(key, 0.0) for key in a.keys() | b.keys()}


def add_reward_call_stats(
    metrics: StepMetrics, reward_fn: GuardedReward | RayPooledReward, carried: Mapping[str, float] | None = None
) -> None:
    """``reward/calls|failures|timeouts|nonfinite`` (and per-term means) since the last step, over the ranks;
    ``carried``: this step's counts set aside while an evaluation ran (`RLTrainer.evaluate`)."""
    metrics.add("reward_calls", add_counts(reward_fn.pop_stats(), carried or {}), _reward_call_view)


def add_rollout_server_stats(metrics: StepMetrics, rollout: object) -> None:
    """A rollout server's or actor pool's counts since the last step (``rollout_server/*``, ``rollout_actors/*``),
    summed over the ranks; nothing for engines that count nothing (every rank has the same kind of engine)."""
    if isinstance(rollout, ReportsStats):
        metrics.add("rollout_server", rollout.pop_stats())


def _dynamic_view(raw: dict[str, float]) -> dict[str, float]:
    out = {k: v for k, v in raw.items() if not k.endswith("_max")}
    out |= {"rounds": raw["rounds_max"], "cap_hit": raw["cap_hit_max"]}
    return {f"dynamic_sampling/{k}": v for k, v in out.items()}


def add_dynamic_sampling_stats(metrics: StepMetrics, local: Mapping[str, float]) -> None:
    """Dynamic sampling's counts summed over the ranks (``rounds`` and ``cap_hit``: the maximum), as
    ``dynamic_sampling/*``."""
    raw = dict(local) | {"rounds_max": local["rounds"], "cap_hit_max": local["cap_hit"]}
    metrics.add("dynamic_sampling", raw, _dynamic_view)


def _workflow_view(raw: dict[str, float]) -> dict[str, float]:
    episodes = max(raw.pop("episodes"), 1.0)
    return {f"episode/{k}": v / episodes if not k.startswith("tool_errors/") else v for k, v in raw.items()}


def add_workflow_stats(metrics: StepMetrics, trajectories: Sequence[Trajectory]) -> None:
    """Per-episode means over the global batch: turns, tool calls, tool errors by kind (totals), stop reasons."""
    metrics.add("workflow", episode_counts(trajectories), _workflow_view)


def add_partial_rollout_stats(metrics: StepMetrics, counts: Mapping[str, float]) -> None:
    """``partial/*`` from every rank's per-token staleness counts (`SampledBatch.stats`: sums, and the oldest
    token's lag by max). A batch restored from a checkpoint written before the counts existed adds zeros."""
    raw = {k: counts.get(k, 0.0) for k in STALENESS_COUNTS} | {"lag_max": counts.get("lag_max", 0.0)}
    metrics.add("partial", raw, staleness_metrics)


def add_actor_stats(metrics: StepMetrics, stats: Mapping[str, torch.Tensor], prefix: str = "actor/") -> None:
    """A loss function's merged statistics (`LossOutput.stats`: sums and extremes), as ``prefix`` + name."""

    def view(raw: dict[str, float]) -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in summarize_stats({k: torch.tensor(v) for k, v in raw.items()}).items()}

    metrics.add(prefix.rstrip("/"), stats, view)


def add_correction_stats(metrics: StepMetrics, stats: Mapping[str, torch.Tensor]) -> None:
    """Rollout correction's raw statistics (`correct_batch`) as ``rollout_corr/*``."""

    def view(raw: dict[str, float]) -> dict[str, float]:
        return summarize_correction_stats({k: torch.tensor(v, dtype=torch.float64) for k, v in raw.items()})

    metrics.add("rollout_corr", stats, view)


def add_behaviour_gap(metrics: StepMetrics, gap: Mapping[str, Any]) -> None:
    """``behaviour_kl``: mean |trainer - engine| log-prob per target token over the global batch (`behaviour_gap`)."""
    metrics.add("behaviour", gap, _behaviour_view)


def _behaviour_view(raw: dict[str, float]) -> dict[str, float]:
    count = raw["num_tokens"]
    return {"behaviour_kl": raw["behaviour_gap"] / count if count > 0 else 0.0}


def _stream_view(raw: dict[str, float]) -> dict[str, float]:
    groups, ranks = max(raw["groups"], 1.0), max(raw["ranks"], 1.0)
    out = {
        "stream/staleness_mean": raw["staleness_sum"] / groups,
        "stream/staleness_max": raw["staleness_max"],
        "stream/version_spread": raw["start_version_max"] - raw["start_version_min"],
        "stream/start_version_min": raw["start_version_min"],
        "stream/in_flight": raw["in_flight"],
        "stream/trainer_idle_frac": raw["trainer_idle_frac_sum"] / ranks,
        "stream/generator_idle_frac": raw["generator_idle_frac_sum"] / ranks,
        "stream/regenerated": raw["regenerated"],
        "stream/filtered_all_pass": raw.get("filtered_all_pass", 0.0),
        "stream/filtered_all_fail": raw.get("filtered_all_fail", 0.0),
        "stream/cap_hit_frac": raw.get("cap_hit", 0.0) / ranks,
    }
    for name, value in raw.items():
        if name.startswith("staleness_") and name[len("staleness_") :].isdigit():
            out[f"stream/{name}_frac"] = value / groups
    return out


def add_stream_stats(metrics: StepMetrics, local: Mapping[str, float]) -> None:
    """Streaming rollouts (`streaming_source.stream_stats`): ``stream/staleness_mean|max``, the histogram
    ``stream/staleness_{s}_frac`` (share of the batch's groups s steps stale), ``stream/version_spread`` (newest minus
    oldest start version in the batch, over ranks), ``stream/in_flight`` (groups generating or finished-unused, all
    ranks), ``stream/trainer_idle_frac`` (time the trainer waited for batches / time since its first batch, mean over
    ranks), ``stream/generator_idle_frac``, ``stream/regenerated`` (too-stale groups generated again, cumulative); with
    dynamic sampling ``stream/filtered_all_pass|all_fail`` (groups dropped, cumulative, all ranks) and
    ``stream/cap_hit_frac`` (share of ranks whose batch was short: the max_rounds cap)."""
    partial = {*STALENESS_COUNTS, "lag_max"}  # with partial rollouts: reduced by add_partial_rollout_stats
    metrics.add("stream", {k: v for k, v in local.items() if k not in partial}, _stream_view)


def add_source_stats(metrics: StepMetrics, sampled: Any, config: Any) -> None:
    """What the batch source adds to a step of an asynchronous trainer (GRPO, PPO; ``sampled``: its `SampledBatch`):
    ``staleness`` (steps between the batch and its oldest group's weights), ``rollout_policy_step``,
    ``rollout_wait_s``, ``generate_overlap_s``; ``partial/*`` with partial rollouts and ``stream/*`` when streaming
    (every rank's counts, reduced with the step's others). Nothing for synchronous rollouts."""
    if not config.async_rollouts:
        return
    metrics.put({
        "staleness": float(sampled.index - sampled.policy_step),
        "rollout_policy_step": float(sampled.policy_step),
        "rollout_wait_s": sampled.wait_s,
        "generate_overlap_s": max(sampled.generate_s - sampled.wait_s, 0.0),
    })  # fmt: skip
    if config.rollout.partial_rollouts:  # every rank's counts, summed: the whole batch's staleness
        add_partial_rollout_stats(metrics, sampled.stats)
    if config.streaming_rollouts:  # every rank's groups: staleness histogram, version spread, in flight, idle
        add_stream_stats(metrics, sampled.stats)
