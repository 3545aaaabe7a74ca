"""How the RL trainers (GRPO, PPO) turn a step's prompts into trajectories: through a workflow
(`shardforge.rollout.workflows`), one generation round at a time, optionally wrapped in
dynamic sampling (`shardforge.algorithms.trainers.rl.dynamic_sampling`).

Round 0 of batch ``index`` is the step's usual prompts (``GlobalBatchSampler(seed)``, this rank's
share); dynamic sampling's backfill round r draws from its own prompt stream (seed ``seed + 7919 r``).
Each prompt's episodes sample from a seed of (seed, batch index, round, the prompt's position in the
round's global batch) (`rollout.seeds`), never of the dp rank or batch row: a resumed run, the
asynchronous mode (batches generated on another thread) and every data-parallel layout (world 1, FSDP 2,
...) sample the same responses from the same weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from shardforge.algorithms.data import GlobalBatchSampler
from shardforge.algorithms.data.source_set import IndexSampler
from shardforge.algorithms.trainers.rl.advantages import GreedyBaseline
from shardforge.algorithms.trainers.rl.common import RLTrainerConfig
from shardforge.algorithms.trainers.rl.dynamic_sampling import DynamicSampler, GenerateRoundFn, keep_exchange
from shardforge.algorithms.trainers.rl.sources import SampleFn
from shardforge.engine.objectives.rewards import RewardShapingConfig, shape_rewards
from shardforge.rollout import RolloutEngine, SamplingParams
from shardforge.rollout.seeds import request_seed
from shardforge.rollout.server.shared_restart import generation_round
from shardforge.rollout.types import PromptSet
from shardforge.rollout.workflows import EpisodeList, PromptRow, Workflow, build_workflow, run_episodes

if TYPE_CHECKING:  # the launching process imports this module for the config; only ranks build engines
    from shardforge.engine import TrainEngine

__all__ = ["build_rl_workflow", "make_sample_fn", "workflow_groups_fn", "workflow_round_fn"]


def build_rl_workflow(config: RLTrainerConfig, tokenizer: Any, reward_fn: Any, budget: int) -> Workflow:
    """The configured workflow; episodes stop before ``workflow.max_total_tokens`` (default: ``budget``,
    the trainer's micro-batch token budget, so every trajectory fits one micro-batch)."""
    return build_workflow(
        replace(config.workflow, max_total_tokens=config.workflow.max_total_tokens or budget), tokenizer, reward_fn
    )


def workflow_round_fn(
    config: RLTrainerConfig,
    rollout: RolloutEngine,
    prompts: PromptSet,
    workflow: Workflow,
    engine: TrainEngine,
    make_sampler: Callable[[int], IndexSampler] | None = None,
    baseline: GreedyBaseline | None = None,
) -> GenerateRoundFn:
    """(batch index, round) -> this rank's trajectories (``group_size`` consecutive per prompt) and raw rewards.
    ``make_sampler``: seed -> the prompt sampler (`trainers.rl_data.PromptData.sampler`, e.g. a mixture);
    default: uniform over ``prompts``. ``baseline``: collected with each round's episodes (ReMax's greedy ones)."""
    samplers: dict[int, IndexSampler] = {}
    dp_rank, dp_size = engine.dp_rank, engine.dp_size

    def sample(index: int, round_: int) -> tuple[list[Any], torch.Tensor]:
        if round_ not in samplers:
            seed = config.seed + 7_919 * round_
            if make_sampler is not None:
                samplers[round_] = make_sampler(seed)
            else:
                samplers[round_] = GlobalBatchSampler(len(prompts), config.prompts_per_step, seed=seed)
        indices = samplers[round_].local_batch(index, dp_rank, dp_size)
        # This rank's prompts are positions dp_rank, dp_rank + dp_size, ... of the global batch (local_batch).
        positions = range(dp_rank, dp_size * len(indices), dp_size)
        seed, params = _round_params(config, index, round_)
        rows = [
            PromptRow.from_prompts(prompts, i, index=g, seed=request_seed(seed, position, config.group_size))
            for g, (i, position) in enumerate(zip(indices, positions, strict=True))
        ]

        def episodes() -> EpisodeList:
            # Every (prompt, sample) is one concurrent episode; their generate calls are batched per round.
            # max_failed_fraction=0: a crash raises as it is (no group is dropped).
            drop = config.workflow.max_failed_fraction > 0
            trajectories = run_episodes(workflow, rollout, rows, config.group_size, params, drop_failed=drop)
            if baseline is not None:  # ReMax: the prompts' greedy episodes, scored as the samples are
                baseline.collect(workflow, rollout, rows, params, trajectories)
            return trajectories

        # A rollout server shared by the ranks that dies in the round: the ranks agree at its end, rank 0
        # restarts it, and the ranks that lost requests run the whole round again (same seeds: whole groups).
        trajectories = generation_round(rollout, episodes)
        return trajectories, torch.tensor([t.reward for t in trajectories], dtype=torch.float32)

    return sample


def _round_params(config: RLTrainerConfig, index: int, round_: int) -> tuple[int, SamplingParams]:
    """The seed of round ``round_`` of batch ``index`` (each prompt's is `request_seed` of it) and its sampling."""
    seed = (config.seed * 1_000_003 + index) * 1_009 + 104_729 * round_
    return seed, SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature, seed=seed)


def workflow_groups_fn(
    config: RLTrainerConfig,
    rollout: RolloutEngine,
    prompts: PromptSet,
    workflow: Workflow,
    engine: TrainEngine,
    make_sampler: Callable[[int], IndexSampler] | None = None,
    baseline: GreedyBaseline | None = None,
) -> Callable[[list[int]], list[tuple[list[Any], torch.Tensor]]]:
    """The streaming source's groups function (`rl.streaming.GroupsFn`): this rank's prompt numbers -> each one's
    ``group_size`` trajectories and (shaped) rewards, generated in one round. Prompt ``q`` is row ``q % local`` of
    this rank's share of global batch ``q // local`` (``local = prompts_per_step / dp_size``), with exactly the seed
    round 0 of that batch gives it (`workflow_round_fn`; every request carries its own seed, so prompts of several
    batches may share a call): with the same weights a group is the synchronous trainer's, so ``max_staleness=0``
    trains on the synchronous batches. Its trajectories' ``group`` is ``q`` (unique in a batch). ``baseline``:
    ReMax's greedy episodes, generated in the same call (under the same weights) and carried on the group's
    trajectories (``baseline_reward``), as `workflow_round_fn` collects them per round."""
    dp_rank, dp_size = engine.dp_rank, engine.dp_size
    local = config.prompts_per_step // dp_size
    if make_sampler is not None:
        sampler = make_sampler(config.seed)
    else:
        sampler = GlobalBatchSampler(len(prompts), config.prompts_per_step, seed=config.seed)
    shares: dict[int, list[int]] = {}  # batch index -> this rank's prompt indices (a mixture's draw advances state)
    drop = config.workflow.max_failed_fraction > 0

    def row_of(q: int) -> PromptRow:
        index, row = divmod(q, local)
        if index not in shares:
            shares[index] = sampler.local_batch(index, dp_rank, dp_size)
            for old in [k for k in shares if k < index - 64]:  # regenerated prompts reach back at most a few batches
                del shares[old]
        seed, _ = _round_params(config, index, 0)
        position = dp_rank + dp_size * row  # in the global batch, as workflow_round_fn numbers it
        return PromptRow.from_prompts(prompts, shares[index][row], index=q, seed=request_seed(seed, position,
                                                                                             config.group_size))  # fmt: skip

    rows_lock = threading.Lock()  # several generator workers: the sampler's draws, one batch at a time

    def groups(positions: list[int]) -> list[tuple[list[Any], torch.Tensor]]:
        with rows_lock:
            rows = [row_of(q) for q in positions]
        _, params = _round_params(config, positions[0] // local, 0)  # the rows' own seeds decide the samples

        def episodes() -> EpisodeList:
            trajectories = run_episodes(workflow, rollout, rows, config.group_size, params, drop_failed=drop)
            if baseline is not None:  # ReMax: each prompt's greedy episode, with its group
                baseline.collect(workflow, rollout, rows, params, trajectories)
            return trajectories

        trajectories = generation_round(rollout, episodes)
        out = []
        for q in positions:  # a failed episode dropped (workflow.max_failed_fraction > 0) leaves its group short
            mine = [t for t in trajectories if t.group == q]
            rewards = torch.tensor([t.reward for t in mine], dtype=torch.float32)
            out.append((mine, _shape(config, mine, rewards)))
        return out

    return groups


def _shape(config: RLTrainerConfig, trajectories: list[Any], rewards: torch.Tensor) -> torch.Tensor:
    """``reward_shaping`` (DAPO overlong penalty, scale, clip; per sample) of raw rewards."""
    if config.reward_shaping == RewardShapingConfig():
        return rewards
    generated = torch.tensor([sum(1 for m in t.loss_mask if m) for t in trajectories], dtype=torch.float32)
    return shape_rewards(rewards, config.reward_shaping, response_lengths=generated)


def make_sample_fn(
    config: RLTrainerConfig, generate_round: GenerateRoundFn, engine: TrainEngine
) -> tuple[SampleFn, DynamicSampler | None]:
    """The per-batch sampler: round 0 as it is, or dynamic sampling over rounds (returned too, for its stats).
    ``reward_shaping`` (DAPO overlong penalty, scale, clip) applies after sampling: dynamic sampling
    filters on the raw rewards. Collective with dynamic sampling on (its exchange's process group)."""
    dynamic = None
    sample_fn: SampleFn = lambda index: generate_round(index, 0)  # noqa: E731
    if config.dynamic_sampling.enabled:
        dp_rank, dp_size = engine.dp_rank, engine.dp_size
        dynamic = DynamicSampler(
            generate_round, group_size=config.group_size, target_groups=config.prompts_per_step // dp_size,
            config=config.dynamic_sampling, dp_rank=dp_rank, dp_size=dp_size, exchange=keep_exchange(dp_rank, dp_size),
        )  # fmt: skip
        sample_fn = dynamic
    if config.reward_shaping == RewardShapingConfig():
        return sample_fn, dynamic
    raw_fn = sample_fn

    def shaped(index: int) -> tuple[list[Any], torch.Tensor]:
        trajectories, rewards = raw_fn(index)
        return trajectories, _shape(config, trajectories, rewards)

    return shaped, dynamic
