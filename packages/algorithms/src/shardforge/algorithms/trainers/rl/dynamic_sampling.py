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
4. the first ``target_groups`` kept groups in generation order (round, then the prompt's position in the
   round's **global** batch) are the step's batch. If the cap on rounds is hit first, the step trains on
   fewer groups (``cap_hit`` is logged, with a warning).

Under data parallelism each rank generates its share of every round (global positions ``dp_rank``,
``dp_rank + dp_size``, ...), and the ranks exchange which of their groups are informative after each
round (`keep_exchange`: a few bools per rank, over a gloo group of its own, so it also runs on the
asynchronous generator thread). Every rank then applies the rule above to the global batch and keeps
its own share of the chosen groups: the trained set, the number of rounds and every statistic are
those of world 1, whatever the layout (losses agree because the engine normalises over the global
batch). The shares may be uneven; a rank left with none keeps its last generated group (advantage 0:
no policy gradient) so that every rank still has a batch; only then do layouts train on different
token sets (the placeholder's tokens count in the loss normalisation).

It keeps its statistics per batch index for the trainer to `pop_stats` (and reduce over ranks) when
it trains on that batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardforge.rollout.types import Rollout

__all__ = [
    "DynamicSampler",
    "DynamicSamplingConfig",
    "GenerateRoundFn",
    "KeepExchange",
    "filter_groups",
    "group_filter_reason",
    "keep_exchange",
]

logger = logging.getLogger(__name__)

GenerateRoundFn = Callable[[int, int], tuple[list[Rollout], torch.Tensor]]
"""(batch index, round) -> this rank's rollouts (whole groups, consecutive) and raw rewards."""
KeepExchange = Callable[[list[bool]], list[list[bool]]]
"""This rank's per-row "informative" flags of a round -> every data-parallel rank's (index: dp rank). Row ``g`` of
dp rank ``k`` is position ``g * dp_size + k`` of the round's global batch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (off by default)."""

    enabled: bool = False
    """Drop groups whose raw reward has zero variance and backfill with more generation rounds."""
    max_rounds: int = 3
    """Generation rounds per step at most (>= 1; round 0 is the normal batch); when hit, train on fewer groups.
    Streaming rollouts: prompts started are capped at max_rounds x the admission limit instead."""

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


def group_filter_reason(trajectories: list[Any]) -> str | None:
    """Streaming's per-group judgement (`streaming.KeepFn`): None keeps a finished group whose raw rewards
    (``trajectory.reward``, before shaping) differ; else why it is dropped, ``all_pass`` or ``all_fail``."""
    if not trajectories:
        return "all_fail"
    rewards = torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float64)
    keep, all_pass, _ = filter_groups(rewards, len(trajectories))
    if bool(keep[0]):
        return None
    return "all_pass" if bool(all_pass[0]) else "all_fail"


def keep_exchange(dp_rank: int, dp_size: int) -> KeepExchange | None:
    """The flag exchange of a data-parallel run (None at dp 1). Creates a gloo group over the world for it, so the
    exchange never meets the trainer's collectives (it may run on the generator thread): call on every rank, in
    the same order as the other group creations."""
    if dp_size == 1 or not dist.is_initialized():
        return None
    group = dist.new_group(backend="gloo")

    def exchange(flags: list[bool]) -> list[list[bool]]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (dp_rank, flags), group=group)
        by_rank: dict[int, list[bool]] = {}
        for rank, rank_flags in gathered:  # ranks of one dp coordinate (TP/CP ranks) sent the same flags
            by_rank.setdefault(int(rank), list(rank_flags))
        return [by_rank[r] for r in range(dp_size)]

    return exchange


def _row_of_groups(rollouts: list[Rollout], group_size: int) -> list[int]:
    """The batch row of each consecutive group (a workflow trajectory's ``group``; a `Rollout`'s
    ``prompt_index``): rows stay put when a failed episode's group was dropped."""
    rows = []
    for g in range(len(rollouts) // group_size):
        first = rollouts[g * group_size]
        rows.append(int(getattr(first, "group", getattr(first, "prompt_index", g))))
    return rows


class DynamicSampler:
    """A `SampleFn` (batch index -> rollouts, rewards) that filters and backfills; see the module doc.
    ``target_groups`` is this rank's share (``prompts_per_step // dp_size``); ``exchange`` (`keep_exchange`)
    makes the choice global over ``dp_size`` ranks."""

    def __init__(
        self,
        generate_round: GenerateRoundFn,
        *,
        group_size: int,
        target_groups: int,
        config: DynamicSamplingConfig,
        dp_rank: int = 0,
        dp_size: int = 1,
        exchange: KeepExchange | None = None,
    ) -> None:
        if target_groups < 1:
            raise ValueError(f"target_groups={target_groups} must be >= 1")
        if dp_size > 1 and exchange is None:
            raise ValueError(f"dp_size={dp_size} needs an exchange (keep_exchange) to choose groups globally")
        self.generate_round = generate_round
        self.group_size, self.target_groups, self.config = group_size, target_groups, config
        self.dp_rank, self.dp_size, self.exchange = dp_rank, dp_size, exchange
        self._stats: dict[int, dict[str, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, index: int) -> tuple[list[Rollout], torch.Tensor]:
        size, wanted = self.group_size, self.target_groups * self.dp_size
        kept_rollouts: list[Rollout] = []
        kept_rewards: list[torch.Tensor] = []
        stats = {"groups_generated": 0.0, "groups_kept": 0.0, "filtered_all_pass": 0.0, "filtered_all_fail": 0.0}
        last: tuple[list[Rollout], torch.Tensor] | None = None
        rounds = chosen = 0
        while rounds < self.config.max_rounds and chosen < wanted:
            rollouts, rewards = self.generate_round(index, rounds)
            rounds += 1
            keep, all_pass, all_fail = filter_groups(rewards, size)
            stats["groups_generated"] += keep.numel()
            stats["filtered_all_pass"] += float(all_pass.sum())
            stats["filtered_all_fail"] += float(all_fail.sum())
            rows = _row_of_groups(rollouts, size)
            flags = [False] * (max(rows) + 1 if rows else 0)
            for g in torch.nonzero(keep).flatten().tolist():
                flags[rows[g]] = True
            every = self.exchange(flags) if self.exchange is not None else [flags]
            mine, taken = _choose(every, self.dp_rank, wanted - chosen)
            chosen += taken
            group_of_row = {row: g for g, row in enumerate(rows)}
            for row in mine:
                g = group_of_row[row]
                kept_rollouts += rollouts[g * size : (g + 1) * size]
                kept_rewards.append(rewards[g * size : (g + 1) * size])
            if rollouts:
                last = (rollouts[-size:], rewards[-size:])
        stats["groups_kept"] = float(len(kept_rewards))
        stats["rounds"] = float(rounds)
        stats["cap_hit"] = float(chosen < wanted)
        if chosen < wanted:
            logger.warning(
                "dynamic sampling: batch %d kept %d of %d groups after max_rounds=%d rounds; training on fewer "
                "(raise dynamic_sampling.max_rounds, or the task is too easy/hard for the policy)",
                index, chosen, wanted, rounds,
            )  # fmt: skip
        if not kept_rewards:
            if last is None:
                raise RuntimeError(f"dynamic sampling: batch {index} generated no group on this rank")
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


def _choose(flags: list[list[bool]], dp_rank: int, room: int) -> tuple[list[int], int]:
    """The first ``room`` informative groups of a round in global position order (row-major over dp ranks):
    (the rows of ``dp_rank``'s that are among them, how many were chosen in all)."""
    dp_size = len(flags)
    mine: list[int] = []
    taken = 0
    for row in range(max((len(f) for f in flags), default=0)):
        for rank in range(dp_size):
            if taken == room:
                return mine, taken
            if row < len(flags[rank]) and flags[rank][row]:
                taken += 1
                if rank == dp_rank:
                    mine.append(row)
    return mine, taken
