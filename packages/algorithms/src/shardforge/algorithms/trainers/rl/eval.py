"""Held-out evaluation of a policy by sampling: avg@n, unbiased pass@k, greedy accuracy, response length.

Used by the GRPO and PPO trainers at every eval (``eval_sampling.samples > 0``) and by the standalone
``shardforge eval`` (`trainers/eval_run.py`). Prompts are split over the data-parallel ranks; every
rank generates its share with the same reward function the training uses, and the sums are reduced
once (any split gives the same numbers up to the samples themselves, which depend on the seed and
the rank's share).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardforge.engine.objectives.passk import sampled_eval_sums
from shardforge.mesh.collectives import all_reduce_sum
from shardforge.rollout import RolloutEngine, SamplingParams
from shardforge.rollout.seeds import request_seed
from shardforge.rollout.server.shared_restart import generation_round
from shardforge.rollout.types import PromptSet, generate_rollouts

if TYPE_CHECKING:  # the launching process imports this module for the config; only ranks build engines
    from shardforge.engine import TrainEngine

__all__ = ["EvalSamplingConfig", "evaluate_prompts", "held_out_totals", "sampled_metrics", "sampled_sums"]

LocalEval = Callable[[RolloutEngine], dict[str, float]]
"""This rank's share of a held-out evaluation: rollout engine -> sums (the same keys on every rank)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSamplingConfig:
    """Sampled evaluation (verl: ``val_kwargs``); off by default (greedy accuracy only)."""

    samples: int = 0
    """Samples per held-out prompt (n of avg@n and pass@k); 0 = greedy accuracy only."""
    temperature: float = 1.0
    """Sampling temperature of the eval samples."""
    top_p: float = 1.0
    """Nucleus sampling mass of the eval samples."""
    pass_k: tuple[int, ...] = (1,)
    """The k of each reported pass@k (each <= samples)."""
    correct_threshold: float = 1.0
    """A sample counts as correct (for pass@k) when its reward is >= this."""
    seed: int = 1234
    """Seed of the eval generation (each rank offsets it by its dp rank)."""

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise ValueError(f"eval_sampling.samples={self.samples} must be >= 0 (0 = greedy accuracy only)")
        if self.samples and (not self.pass_k or any(not 1 <= k <= self.samples for k in self.pass_k)):
            raise ValueError(
                f"eval_sampling.pass_k={list(self.pass_k)} needs every k in [1, samples={self.samples}]; "
                "lower k or raise eval_sampling.samples"
            )
        if self.samples and self.temperature <= 0:
            raise ValueError("eval_sampling.temperature must be > 0 for sampled evaluation (greedy is always reported)")


def _score(
    reward_fn: Callable[[str, str, str], float], prompts: PromptSet, mine: list[int], outs: list[Any]
) -> list[float]:
    """Rewards of ``outs`` (batched and concurrent when ``reward_fn`` is a `GuardedReward`)."""
    items = [(prompts.texts[mine[o.prompt_index]], o.text, prompts.references[mine[o.prompt_index]]) for o in outs]
    score_many = getattr(reward_fn, "score_many", None)
    return list(score_many(items)) if score_many is not None else [float(reward_fn(*item)) for item in items]


def held_out_totals(
    rollout: RolloutEngine,
    engine: TrainEngine,
    local: LocalEval,
    runner: Callable[[Callable[[RolloutEngine], Any]], Any] | None = None,
) -> dict[str, float]:
    """THE held-out evaluation skeleton: run ``local`` (this rank's share) as one generation round (a rollout server
    the ranks share and that dies in it is restarted, and the round run again: `generation_round`), on ``runner``'s
    thread when given (the thread that owns the rollout engine, e.g. `AsyncRollouts.evaluate`), then sum its sums
    over ``engine``'s data-parallel ranks in one collective, on the calling thread."""

    def round_(rollout_: RolloutEngine) -> dict[str, float]:
        return generation_round(rollout_, lambda: local(rollout_))

    local_sums = round_(rollout) if runner is None else runner(round_)
    names = sorted(local_sums)
    reduced = all_reduce_sum(*(local_sums[k] for k in names), group=engine.dp_group, device=engine.device)
    return dict(zip(names, reduced, strict=True))


def sampled_sums(rewards: list[list[float]], sampling: EvalSamplingConfig) -> dict[str, float]:
    """``avg@n`` and ``pass@k`` sums of the sampled rewards of this rank's prompts (one row per prompt)."""
    correct = [[r >= sampling.correct_threshold for r in row] for row in rewards]
    return {k: v for k, v in sampled_eval_sums(rewards, correct, sampling.pass_k).items() if k != "num_prompts"}


def sampled_metrics(totals: dict[str, float], count: int, sampling: EvalSamplingConfig) -> dict[str, float]:
    """``avg@n``, ``pass@k`` and ``sampled_response_len_mean`` from the reduced sums (empty without samples)."""
    n = sampling.samples
    if not n:
        return {}
    result = {k: v / count for k, v in totals.items() if k.startswith(("avg@", "pass@"))}
    return result | {"sampled_response_len_mean": totals["sampled_len"] / (count * n)}


def evaluate_prompts(
    rollout: RolloutEngine,
    prompts: PromptSet,
    engine: TrainEngine,
    reward_fn: Callable[[str, str, str], float],
    sampling: EvalSamplingConfig,
    max_new_tokens: int,
    limit: int | None = None,
    *,
    runner: Callable[[Callable[[RolloutEngine], Any]], Any] | None = None,
) -> dict[str, float]:
    """Greedy ``accuracy`` (reward >= correct_threshold) and ``response_len_mean``; with samples > 0
    also ``avg@n``, ``pass@k`` and ``sampled_response_len_mean``. Collective over ``engine``'s dp group.

    ``runner`` runs the local generation (e.g. `AsyncRollouts.evaluate`, on the thread that owns the
    rollout engine); the reduction across ranks happens here, on the calling thread."""
    count = len(prompts) if limit is None else min(limit, len(prompts))
    mine = list(range(count))[engine.dp_rank :: engine.dp_size]
    n, ks = sampling.samples, sampling.pass_k

    def local(rollout_: RolloutEngine) -> dict[str, float]:
        sums = {"correct": 0.0, "greedy_len": 0.0, "sampled_len": 0.0}
        if n:
            sums |= {f"avg@{n}": 0.0} | {f"pass@{k}": 0.0 for k in ks}
        if not mine:
            return sums
        ids, images = [prompts.ids[i] for i in mine], [prompts.image(i) for i in mine]
        greedy = generate_rollouts(rollout_, ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0), images)
        for out, reward in zip(greedy, _score(reward_fn, prompts, mine, greedy), strict=True):
            sums["correct"] += float(reward >= sampling.correct_threshold)
            sums["greedy_len"] += len(out.response_ids)
        if n:
            params = SamplingParams(
                n=n, max_new_tokens=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                seeds=tuple(request_seed(sampling.seed, i, n) for i in mine),  # by prompt, not rank: any layout
            )  # fmt: skip
            sampled = generate_rollouts(rollout_, ids, params, images)
            rewards: list[list[float]] = [[] for _ in mine]
            for out, reward in zip(sampled, _score(reward_fn, prompts, mine, sampled), strict=True):
                rewards[out.prompt_index].append(reward)
                sums["sampled_len"] += len(out.response_ids)
            sums |= sampled_sums(rewards, sampling)
        return sums

    totals = held_out_totals(rollout, engine, local, runner)
    result = {"accuracy": totals["correct"] / count, "response_len_mean": totals["greedy_len"] / count}
    return result | sampled_metrics(totals, count, sampling)
