"""Dynamic sampling (DAPO, Yu et al. 2025): drop groups that carry no learning signal and backfill.

A GRPO-style group whose samples all got the same reward has advantage 0 on every token (the
group baseline equals each reward): it costs a forward and backward pass and teaches nothing.
`DynamicSampler` wraps a per-round generator and, for each step:

1. round 0 generates the step's usual prompts (exactly what the run does without dynamic sampling);
2. groups whose **raw verifier reward** (the reward function's output, before any shaping) has
   zero variance are dropped, by reason: ``all_pass`` (every sample rewarded > 0: solved) or
   ``all_fail`` (every sample <= 0);
3. while fewer than ``target_groups`` groups are kept and fewer than ``max_rounds`` rounds ran,
   another round generates fresh prompts (a deterministic stream per round) and backfills;
4. the first ``target_groups`` kept groups (in generation order) are the step's batch. If the cap
   on rounds is hit first, the step trains on fewer groups (``cap_hit`` is logged, with a warning);
   a rank left with none keeps its last generated group (advantage 0: no policy gradient) so that
   every rank still has a batch.

It runs on whichever thread generates (no collectives), so it works under `SyncRollouts` and
`AsyncRollouts` alike; each data-parallel rank fills its own share of the groups, as each rank
samples its own share of the prompts. Statistics are kept per batch index for the trainer to
`pop_stats` (and reduce over ranks) when it trains on that batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardforge.algorithms.rollout.types import Rollout

__all__ = ["DynamicSampler", "DynamicSamplingConfig", "GenerateRoundFn", "filter_groups"]

logger = logging.getLogger(__name__)

GenerateRoundFn = Callable[[int, int], tuple[list[Rollout], torch.Tensor]]
"""(batch index, round) -> this rank's rollouts (whole groups, consecutive) and raw rewards."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (off by default)."""

    enabled: bool = False
    """Drop groups whose raw reward has zero variance and backfill with more generation rounds."""
    max_rounds: int = 3
    """Generation rounds per step at most (>= 1; round 0 is the normal batch); when hit, train on fewer groups."""

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"dynamic_sampling.max_rounds={self.max_rounds} must be >= 1 (1 = filter, no backfill)")


def filter_groups(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of ``group_size`` consecutive samples: (keep, all_pass, all_fail) bool [G] masks.

    A group is dropped when its rewards are all equal (zero variance): ``all_pass`` if they are > 0,
    else ``all_fail``. A group of one sample has zero variance by definition (dropped)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {group_size}")
    groups = rewards.double().view(-1, group_size)
    uniform = (groups == groups[:, :1]).all(dim=1)
    all_pass = uniform & (groups[:, 0] > 0)
    return ~uniform, all_pass, uniform & ~all_pass


class DynamicSampler:
    """A `SampleFn` (batch index -> rollouts, rewards) that filters and backfills; see the module doc."""

    def __init__(
        self, generate_round: GenerateRoundFn, *, group_size: int, target_groups: int, config: DynamicSamplingConfig
    ) -> None:
        if target_groups < 1:
            raise ValueError(f"target_groups={target_groups} must be >= 1")
        self.generate_round = generate_round
        self.group_size, self.target_groups, self.config = group_size, target_groups, config
        self._stats: dict[int, dict[str, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, index: int) -> tuple[list[Rollout], torch.Tensor]:
        size, target = self.group_size, self.target_groups
        kept_rollouts: list[Rollout] = []
        kept_rewards: list[torch.Tensor] = []
        stats = {"groups_generated": 0.0, "groups_kept": 0.0, "filtered_all_pass": 0.0, "filtered_all_fail": 0.0}
        last: tuple[list[Rollout], torch.Tensor] | None = None
        rounds = 0
        while rounds < self.config.max_rounds and len(kept_rewards) < target:
            rollouts, rewards = self.generate_round(index, rounds)
            rounds += 1
            keep, all_pass, all_fail = filter_groups(rewards, size)
            stats["groups_generated"] += keep.numel()
            stats["filtered_all_pass"] += float(all_pass.sum())
            stats["filtered_all_fail"] += float(all_fail.sum())
            for g in torch.nonzero(keep).flatten().tolist():
                if len(kept_rewards) < target:
                    kept_rollouts += rollouts[g * size : (g + 1) * size]
                    kept_rewards.append(rewards[g * size : (g + 1) * size])
            last = (rollouts[-size:], rewards[-size:])
        stats["groups_kept"] = float(len(kept_rewards))
        stats["rounds"] = float(rounds)
        stats["cap_hit"] = float(len(kept_rewards) < target)
        if len(kept_rewards) < target:
            logger.warning(
                "dynamic sampling: batch %d kept %d of %d groups after max_rounds=%d rounds; training on fewer "
                "(raise dynamic_sampling.max_rounds, or the task is too easy/hard for the policy)",
                index, len(kept_rewards), target, rounds,
            )  # fmt: skip
        if not kept_rewards:
            assert last is not None
            kept_rollouts, kept_rewards = last[0], [last[1]]
        with self._lock:
            self._stats[index] = stats
        return kept_rollouts, torch.cat(kept_rewards)

    def pop_stats(self, index: int) -> dict[str, float]:
        """The statistics of batch ``index`` (zeros for a batch restored from a checkpoint)."""
        with self._lock:
            stats = self._stats.pop(index, None)
        if stats is None:
            names = ("groups_generated", "groups_kept", "filtered_all_pass", "filtered_all_fail", "rounds", "cap_hit")
            return dict.fromkeys(names, 0.0)
        return stats
