"""PPO with a learned critic on verifiable rewards (`shardforge train ppo`).

Like GRPO (`shardforge.algorithms.trainers.grpo`: embedded rollout engine, weight publishing after each
step, reward functions, eval) but the advantage comes from a critic: a value-head `TrainEngine`
initialised from the policy checkpoint (new head) or from a reward-model directory. Each step:
trajectories from a workflow (``workflow.name``: rlvr, multi_turn, tool_use or a user's; with
optional dynamic sampling) -> sequence rewards -> optional KL-in-reward against a frozen reference
policy -> GAE on per-token values over the generated tokens only (tool results, user turns and
template markers have loss mask 0: no value target, no advantage, no loss) -> rollout correction
of the actor's batch (``rollout_correction``, as GRPO) -> actor steps (PPO clip) and critic steps
(value-clipped loss) -> publish the actor's weights. See `shardforge.algorithms.trainers.rl.ppo_update` for the update itself.
Batches come synchronously (default), ``async_rollouts`` (whole batches up to ``max_staleness`` steps ahead) or
``streaming_rollouts`` (groups streamed under the staleness bound, `rl.streaming_source`): a stale batch's values and
GAE are the critic's at the step that trains it, its old log-probs the actor's (the proximal policy), and the rollout
correction weighs it by trainer / behaviour log-probs, as in GRPO's decoupled loss. With ``rollout.partial_rollouts``
(either mode) a weight update interrupts the responses still generating, which continue under the new weights; every
token keeps the version and behaviour log-prob that sampled it, and values and GAE are computed on the finished
trajectory as above, so the path is GRPO's (`rl.partial`).
The shared fields (layout applies to the actor, critic and reference engines; no pp for the
critic) and the run loop are `shardforge.algorithms.trainers.base`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardforge.algorithms.data.prompts import RL_PROMPT_ROW_FIELDS
from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
from shardforge.algorithms.trainers.rl.common import (
    RLTrainerConfig,
    build_reference,
    build_reward_model,
    check_eval_split,
    check_prompt_positions,
    check_rollout_batch,
)
from shardforge.algorithms.trainers.rl.metrics import StepMetrics
from shardforge.algorithms.trainers.rl.partial import check_partial_rollouts
from shardforge.algorithms.trainers.rl.ppo_update import (
    ShiftedCriticLossFn,
    correct_actor_batch,
    ppo_update,
)
from shardforge.algorithms.trainers.rl.sources import SampledBatch
from shardforge.algorithms.trainers.rl.step_stats import add_source_stats
from shardforge.algorithms.trainers.rl.streaming_checks import (
    check_async_recompute,
    check_streaming_config,
    check_streaming_layout,
)
from shardforge.algorithms.trainers.rl_trainer import RLTrainer
from shardforge.algorithms.trainers.run.common import with_total_steps
from shardforge.algorithms.trainers.run.config import TrainerConfig
from shardforge.algorithms.trainers.run.profiling import phase
from shardforge.engine.config import EngineConfig
from shardforge.engine.objectives import KLEstimator, PPOActorLossFn, PPOCriticConfig
from shardforge.engine.objectives.rollout_correction import ROLLOUT_CORRECTIONS
from shardforge.rollout.types import PromptSet

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    from shardforge.engine import TrainEngine

__all__ = ["PPOConfig", "PPOTrainer", "ShiftedCriticLossFn", "run_ppo"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOConfig(RLTrainerConfig):
    """Everything `shardforge train ppo` needs (shared fields: `TrainerConfig`, `RLTrainerConfig`; ``engine`` is the actor's)."""

    critic_model: str | None = None
    """Critic start: a reward-model / value-model directory or an LM directory (new head); None = model."""
    update_epochs: int = 2
    """Optimizer steps of the actor and of the critic per rollout batch (clipping acts from the second)."""
    group_size: int = 1
    """Samples per prompt."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0 / std 1 over the global batch."""
    kl_coef: float = 0.0
    """Per-token KL penalty to the reference policy, subtracted from the reward (0 = no reference)."""
    kl_estimator: KLEstimator = "k1"
    """KL estimator of the penalty (k1 = log pi - log pi_ref)."""
    critic: PPOCriticConfig = field(default_factory=PPOCriticConfig)
    """Critic loss options (value clip, mse/huber)."""
    critic_engine: EngineConfig = field(default_factory=EngineConfig)
    """Critic engine settings (head is forced to "value")."""
    async_rollouts: bool = False
    """Generate the next batch in a background thread while the current step trains (decoupled PPO loss, as GRPO's);
    the critic's values and GAE are computed when the batch is trained, with the critic's weights of that step."""
    streaming_rollouts: bool = False
    """With async_rollouts=true: stream prompt groups continuously instead of whole batches (as GRPO's
    streaming_rollouts): each step trains on the first prompts_per_step complete groups to finish, none more than
    max_staleness steps stale (stream/* metrics); values and GAE as with async_rollouts."""
    max_staleness: int = 1
    """Async mode: batch k is generated with the weights after step max(k - max_staleness, 0); 0 = on-policy.
    Streaming: a trained group started under the weights of step k - max_staleness or newer."""

    def __post_init__(self) -> None:
        TrainerConfig.__post_init__(self)
        check_streaming_config(self)


def _validate(config: PPOConfig, prompts: PromptSet, dp_size: int) -> None:
    budget = min(config.engine.max_tokens_per_microbatch, config.critic_engine.max_tokens_per_microbatch)
    check_rollout_batch(
        config, prompts, dp_size, budget, f"the smaller max_tokens_per_microbatch of engine/critic_engine is {budget}"
    )
    if config.update_epochs < 1:
        raise ValueError(f"update_epochs={config.update_epochs} must be >= 1")
    if config.kl_coef < 0:
        raise ValueError(f"kl_coef={config.kl_coef} must be >= 0")
    if config.kl_ctrl.kl_coef not in (0.0, config.kl_coef):
        raise ValueError(
            f"kl_ctrl.kl_coef={config.kl_ctrl.kl_coef} differs from kl_coef={config.kl_coef}: set the (initial) "
            "coefficient with kl_coef only"
        )
    if config.kl_ctrl.type != "fixed" and config.kl_coef == 0:
        raise ValueError(
            f"kl_ctrl.type={config.kl_ctrl.type!r} steers kl_coef, which is 0 (no reference model, no KL): "
            "set kl_coef > 0 as the starting coefficient"
        )
    if config.dynamic_sampling.enabled and config.group_size < 2:
        raise ValueError(
            f"dynamic_sampling drops groups whose rewards are all equal, so it needs group_size >= 2 (got "
            f"{config.group_size}): raise group_size or set dynamic_sampling.enabled=false"
        )
    if config.dynamic_sampling.enabled and config.rollout.engine == "vllm" and config.rollout.vllm.placement == "rank0":
        if dp_size > 1:
            raise ValueError(
                "dynamic_sampling with rollout.vllm.placement=rank0 and several data-parallel ranks is not supported yet "
                "(never run); use rollout.vllm.placement=each_rank or rollout.engine=hf"
            )
    if config.max_staleness < 0:
        raise ValueError(f"max_staleness={config.max_staleness} must be >= 0 (0 = on-policy, no overlap)")
    check_partial_rollouts(config)
    check_streaming_layout(config, dp_size)
    check_async_recompute(config)
    if config.actor.behav_weight_cap is not None:
        raise ValueError(
            f"actor.behav_weight_cap={config.actor.behav_weight_cap} is not used by PPO: the behaviour weight of "
            "every batch is rollout_correction's (e.g. rollout_correction: {mode: token_mis, high: 5.0})"
        )


class PPOTrainer(RLTrainer[PPOConfig]):
    """Actor (``engine``), critic and an optional frozen reference; checkpoints hold actor and critic."""

    name = "ppo"
    advantage_stage = "gae"

    def token_budget(self) -> int:
        config = self.config
        return min(config.engine.max_tokens_per_microbatch, config.critic_engine.max_tokens_per_microbatch)

    def kl_coefficient(self) -> float:
        return self.config.kl_coef

    def build_engines(self) -> TrainEngine:
        from shardforge.engine import TrainEngine

        config = self.config
        total = config.steps * config.update_epochs
        actor = TrainEngine(config.model, config.layout, with_total_steps(config.engine, total))
        _validate(config, self.prompts, actor.dp_size)
        check_prompt_positions(config, self.prompts, actor.hf_config)
        check_eval_split(config, len(self.held_out) if self.held_out is not None else None, actor.dp_size)
        critic_config = dataclasses.replace(with_total_steps(config.critic_engine, total), head="value")
        self.critic = TrainEngine(config.critic_model or config.model, config.layout, critic_config)
        # KL in the reward (kl_coef) or in the actor loss (actor.kl_coef) needs the reference's log-probs
        self.reference = build_reference(config, config.kl_coef > 0 or config.actor.kl_coef > 0)
        self.reward_model = build_reward_model(config, actor)
        if config.temperature > 0:  # log-probs of the distribution the rollouts sample from (as GRPO)
            actor.logprob_temperature = config.temperature
        return actor

    def data_state(self) -> dict[str, Any]:
        # engine steps per iteration: the resume point depends on it
        return super().data_state() | {"update_epochs": self.config.update_epochs}

    def checkpoint_engines(self) -> dict[str, TrainEngine]:
        return {"checkpoints": self.engine, "critic_checkpoints": self.critic}

    def start_step(self) -> int:
        return self.engine.step // self.config.update_epochs

    def setup(self, start: int, restored: dict[str, Any]) -> None:
        config = self.config
        self.build_source(
            start, restored, [self.engine, self.critic], asynchronous=config.async_rollouts,
            max_staleness=config.max_staleness, streaming=config.streaming_rollouts,
        )  # fmt: skip
        self.advantages = self.build_advantage_stage()  # after the source: it holds the KL controller
        self.actor_fn, self.critic_fn = PPOActorLossFn(config.actor), ShiftedCriticLossFn(config.critic)

    def update(self, sampled: SampledBatch, metrics: StepMetrics) -> dict[str, float]:
        config, actor = self.config, self.engine
        started = time.perf_counter()
        served = float(sampled.rollouts[0].version)  # the version that sampled (async: its oldest group's or newer)
        batch = trajectories_to_batch(sampled.rollouts, self.advantages.sequence_advantages(sampled, metrics))
        self.advantages.token_advantages(batch, sampled, metrics)  # GAE with the critic (and its targets)
        recompute = config.recompute_logprobs and ROLLOUT_CORRECTIONS.get(config.rollout_correction.mode).recompute
        actor_batch = correct_actor_batch(batch, config.rollout_correction, actor, metrics) if recompute else None
        forwarded = time.perf_counter()
        with phase("train"):
            stats = ppo_update(
                batch, actor, self.critic, self.actor_fn, self.critic_fn, epochs=config.update_epochs,
                actor_batch=actor_batch, metrics=metrics,
            )  # fmt: skip
        metrics.put({"rollout_version": served, "generate_s": sampled.generate_s, "forward_s": forwarded - started})
        add_source_stats(metrics, sampled, config)  # staleness, stream/* (async and streaming rollouts)
        return stats

    def after_step(self, stats: dict[str, float]) -> None:
        if not (math.isfinite(stats["loss"]) and math.isfinite(stats["critic/loss"])):
            raise FloatingPointError(f"PPO loss became {stats['loss']} (critic {stats['critic/loss']})")

    def postfix(self, stats: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{stats['reward_mean']:.3f}", "vloss": f"{stats['critic/loss']:.3f}"}

    def export_extra(self, summary: dict[str, Any]) -> None:
        processor = self.prompt_data.image_processor  # a VLM: the actor's export gets the image processor
        if processor is not None:
            # The VLM critic (engine.vision_value) has no HF class to export to; its checkpoints hold it.
            if self.engine.is_main and "hf_dir" in summary:
                processor.save_pretrained(summary["hf_dir"])
            return
        self.critic.export_hf(self.out / "critic_hf", tokenizer=self.tokenizer)
        summary["critic_hf_dir"] = str(self.out / "critic_hf")


def run_ppo(config: PPOConfig) -> dict[str, Any]:
    """Train; return a summary (accuracy before/after, final reward). Call on every rank."""
    return PPOTrainer(config).run()


TRAINER = TrainerSpec(config_cls=PPOConfig, run=run_ppo, row_fields=RL_PROMPT_ROW_FIELDS)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
