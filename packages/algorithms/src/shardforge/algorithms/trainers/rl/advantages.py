"""The RL step's advantage stage, chosen by name in `ADVANTAGE_STAGES` (STYLE 14, 15).

A stage gives a step's batch its advantages in two places: per trajectory before the batch is packed
(`sequence_advantages`: GRPO's outcome estimators over each prompt's group) and per token once the trainer's old
log-probs exist (`token_advantages`: a teacher's per-token reverse KL for on-policy distillation, 1 on every
teacher token for off-policy distillation). Each adds its statistics to the step's `StepMetrics`. A trainer picks its
stage by name (`RLTrainer.advantage_stage`; distill by ``mode``; PPO: ``gae``, which also prepares its critic's
value targets).

Estimators that compare against a greedy baseline (ReMax: they take ``baseline_rewards``) get a `GreedyBaseline`:
the variant is an object the sampling round and the stage share, not a name checked in several places.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from shardforge.algorithms.trainers.rl.metrics import StepMetrics, means_of
from shardforge.core.registry import Registry
from shardforge.engine.batching import PackedBatch
from shardforge.engine.objectives.advantages import ADVANTAGE_ESTIMATORS, group_advantages
from shardforge.engine.objectives.loss_fns import ADVANTAGES
from shardforge.engine.objectives.rewards import RewardShapingConfig, shape_rewards
from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
from shardforge.rollout import RolloutEngine, SamplingParams
from shardforge.rollout.workflows import PromptRow, Workflow, run_episodes

if TYPE_CHECKING:
    from shardforge.algorithms.trainers.rl.sources import SampledBatch

__all__ = [
    "ADVANTAGE_STAGES",
    "AdvantageStage",
    "GAEAdvantages",
    "GreedyBaseline",
    "GroupAdvantages",
    "SupervisedAdvantages",
    "greedy_baseline",
]

ADVANTAGE_STAGES: Registry[Any] = Registry("advantage stage")


class AdvantageStage:
    """How a step's batch gets its advantages (see the module docstring). The default adds none."""

    baseline: GreedyBaseline | None = None
    """A baseline the sampling round must collect (ReMax's greedy episodes), or None."""

    @classmethod
    def from_trainer(cls, trainer: Any) -> AdvantageStage:
        """The stage for ``trainer`` (its config, and engines such as a teacher)."""
        return cls()

    def sequence_advantages(self, sampled: SampledBatch, metrics: StepMetrics) -> torch.Tensor:
        """[N] float32: each trajectory's advantage, spread over its trained tokens when the batch is packed."""
        return torch.zeros(len(sampled.rollouts))

    def token_advantages(self, batch: PackedBatch, sampled: SampledBatch, metrics: StepMetrics) -> None:
        """Rewrite ``batch.extras[ADVANTAGES]`` once the old log-probs are in the batch (default: keep them)."""


class GreedyBaseline:
    """ReMax (Li et al. 2024): one greedy episode per prompt; its reward (shaped as the samples' are) becomes
    ``baseline_reward`` of the prompt's samples. A prompt whose greedy episode crashed (and was dropped) falls back
    to its samples' mean reward."""

    def __init__(self, shaping: RewardShapingConfig) -> None:
        self.shaping = shaping

    def collect(
        self,
        workflow: Workflow,
        rollout: RolloutEngine,
        rows: list[PromptRow],
        params: SamplingParams,
        trajectories: list[Any],
    ) -> None:
        """Run the greedy episodes of ``rows`` and set every trajectory's ``baseline_reward`` (sampling round)."""
        greedy = run_episodes(workflow, rollout, rows, 1, replace(params, temperature=0.0), drop_failed=True)
        rewards = torch.tensor([t.reward for t in greedy], dtype=torch.float32)
        if self.shaping != RewardShapingConfig():
            lengths = torch.tensor([sum(1 for m in t.loss_mask if m) for t in greedy], dtype=torch.float32)
            rewards = shape_rewards(rewards, self.shaping, response_lengths=lengths)
        baseline = {t.group: float(r) for t, r in zip(greedy, rewards, strict=True)}
        for t in trajectories:
            if t.group not in baseline:
                group = [s.reward for s in trajectories if s.group == t.group]
                baseline[t.group] = sum(group) / len(group)
            t.baseline_reward = baseline[t.group]

    def values(self, trajectories: list[Any], group_size: int, metrics: StepMetrics) -> torch.Tensor:
        """[N / group_size] the baseline of each prompt (its first sample's); ``remax/baseline_mean`` to ``metrics``."""
        baselines = torch.tensor([t.baseline_reward for t in trajectories[::group_size]])
        metrics.add("remax", {"sum": baselines.double().sum(), "count": baselines.numel()}, _baseline_view)
        return baselines


def _baseline_view(raw: dict[str, float]) -> dict[str, float]:
    return {"remax/baseline_mean": raw["sum"] / max(raw["count"], 1.0)}


def greedy_baseline(estimator: str, shaping: RewardShapingConfig) -> GreedyBaseline | None:
    """A `GreedyBaseline` when ``estimator`` compares against one (it takes ``baseline_rewards``), else None."""
    if estimator == "gae":
        return None
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    return GreedyBaseline(shaping) if "baseline_rewards" in inspect.signature(fn).parameters else None


@ADVANTAGE_STAGES.register("group")
class GroupAdvantages(AdvantageStage):
    """GRPO's: an outcome estimator (grpo, dr_grpo, rloo, reinforce_plus_plus, opo, remax, a user's) over each
    prompt's ``group_size`` consecutive samples."""

    def __init__(self, estimator: str, group_size: int, baseline: GreedyBaseline | None = None) -> None:
        self.estimator, self.group_size, self.baseline = estimator, group_size, baseline

    @classmethod
    def from_trainer(cls, trainer: Any) -> AdvantageStage:
        config = trainer.config
        return cls(config.advantage, config.group_size, greedy_baseline(config.advantage, config.reward_shaping))

    def sequence_advantages(self, sampled: SampledBatch, metrics: StepMetrics) -> torch.Tensor:
        lengths = torch.tensor([t.num_generated for t in sampled.rollouts], dtype=torch.float64)
        baselines = None if self.baseline is None else self.baseline.values(sampled.rollouts, self.group_size, metrics)
        return group_advantages(
            sampled.rewards, self.group_size, self.estimator, response_lengths=lengths, baseline_rewards=baselines
        )


@ADVANTAGE_STAGES.register("teacher_nll")
class SupervisedAdvantages(AdvantageStage):
    """Off-policy distillation: advantage 1 on every teacher token (GPG's ``-A log pi`` = the student's NLL of the
    teacher's samples); ``distill/teacher_logprob`` is the teacher's sampling log-prob of its tokens."""

    def token_advantages(self, batch: PackedBatch, sampled: SampledBatch, metrics: StepMetrics) -> None:
        mask = batch.loss_mask != 0
        batch.extras[ADVANTAGES] = mask.to(torch.float32)
        teacher = batch.extras[BEHAVIOUR_LOGPROBS].double()
        metrics.add("distill", {"teacher_logprob": teacher[mask].sum(), "num_tokens": mask.sum()},
                    means_of("num_tokens", prefix="distill/"))  # fmt: skip


@ADVANTAGE_STAGES.register("gae")
class GAEAdvantages(AdvantageStage):
    """PPO's: token rewards (the sequence reward on its last token, minus ``kl_coef`` x the per-token KL to the
    reference when one is built) -> GAE(gamma, lambda) over the critic's values, whitened over the global batch;
    also the old log-probs, old values and returns the critic's update needs (`ppo_update.prepare_ppo_batch`, whose
    moments are one collective of their own, before the update). The KL controller moves here, after the step's
    coefficient was used."""

    def __init__(self, config: Any, actor: Any, critic: Any, reference: Any, kl_ctrl: Any) -> None:
        self.config, self.actor, self.critic, self.reference, self.kl_ctrl = config, actor, critic, reference, kl_ctrl

    @classmethod
    def from_trainer(cls, trainer: Any) -> AdvantageStage:
        return cls(trainer.config, trainer.engine, trainer.critic, trainer.reference, trainer.kl_ctrl)

    def token_advantages(self, batch: PackedBatch, sampled: SampledBatch, metrics: StepMetrics) -> None:
        from shardforge.algorithms.trainers.rl.ppo_update import prepare_ppo_batch
        from shardforge.engine.objectives.rollout_correction import ROLLOUT_CORRECTIONS

        config = self.config
        # Bypass (or recompute_logprobs=false): the engine's log-probs are the old ones.
        recompute = config.recompute_logprobs and ROLLOUT_CORRECTIONS.get(config.rollout_correction.mode).recompute
        prepared = prepare_ppo_batch(
            batch, sampled.rewards, self.actor, self.critic, self.reference, gamma=config.gamma, lam=config.lam,
            kl_coef=self.kl_ctrl.value, kl_estimator=config.kl_estimator,
            whiten_advantages=config.whiten_advantages, recompute_logprobs=recompute,
        )  # fmt: skip
        metrics.put(prepared)
        if self.reference is not None:  # the coefficient this step used, then the controller's move
            metrics.put({"kl_coef": self.kl_ctrl.value})
            self.kl_ctrl.update(prepared["kl_ref"], config.prompts_per_step * config.group_size)
