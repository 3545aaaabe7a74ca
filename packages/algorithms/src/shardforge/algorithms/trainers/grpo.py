"""GRPO (and Dr. GRPO / RLOO) on verifiable rewards: rollouts -> rewards -> group advantages ->
PPO-clip update -> publish weights -> the rollout engine serves the new version.

Every rank runs a `RolloutEngine` (embedded HF generate by default) for its share of the prompts. After each
optimiser step rank 0 publishes the new weights with weight-sync's `DiskTransport` (atomic,
verified versions under ``output_dir/weights``) and every rank's rollout engine switches to
it, so step k+1 samples from the policy after update k (synchronous, on-policy). Old
log-probs are recomputed by the training engine before the update (``recompute_logprobs``),
so the first PPO ratio is exactly 1 (when that is redundant, synchronous rollouts with one update
per batch, they are the training forward's, detached: ``reuse_training_logprobs``); the rollout engine's own log-probs are kept as
``behaviour_logprobs``, and every batch (fresh or stale) is corrected for the gap between the two
by ``rollout_correction`` (`shardforge.engine.objectives.rollout_correction`; metrics
``rollout_corr/*``, and ``behaviour_kl`` = mean |trainer - engine|).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardforge.algorithms.data.prompts import RL_PROMPT_ROW_FIELDS
from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.rl.advantages import AdvantageStage, greedy_baseline
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
from shardforge.algorithms.trainers.rl.sources import SampledBatch
from shardforge.algorithms.trainers.rl.step_stats import (
    add_actor_stats,
    add_behaviour_gap,
    add_correction_stats,
    add_source_stats,
)
from shardforge.algorithms.trainers.rl.streaming_checks import (
    check_async_recompute,
    check_streaming_config,
    check_streaming_layout,
)
from shardforge.algorithms.trainers.rl_trainer import RLTrainer
from shardforge.algorithms.trainers.run.common import with_total_steps
from shardforge.algorithms.trainers.run.config import TrainerConfig
from shardforge.algorithms.trainers.run.profiling import phase
from shardforge.engine.objectives import ADVANTAGE_ESTIMATORS, PPOActorLossFn
from shardforge.engine.objectives.advantages import AdvantageEstimator
from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS, REF_LOGPROBS
from shardforge.engine.objectives.on_policy import OnPolicyActorLossFn, correction_fits_in_loss, has_dropout
from shardforge.engine.objectives.rollout_correction import (
    BEHAVIOUR_LOGPROBS,
    ROLLOUT_CORRECTIONS,
    behaviour_gap,
    correct_batch,
)
from shardforge.rollout.types import PromptSet

if TYPE_CHECKING:  # imported in build_engines: the launcher reads GRPOConfig without the engine
    from shardforge.engine import TrainEngine

__all__ = ["GRPOConfig", "GRPOTrainer", "run_grpo"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig(RLTrainerConfig):
    """Everything `shardforge train grpo` needs (shared fields: `TrainerConfig`, `RLTrainerConfig`)."""

    group_size: int = 8
    """Samples per prompt."""
    advantage: AdvantageEstimator = "grpo"
    """Outcome estimator in ADVANTAGE_ESTIMATORS: grpo, dr_grpo, rloo, reinforce_plus_plus(_baseline), opo, grpo_passk."""
    async_rollouts: bool = False
    """Generate the next batch in a background thread while the current step trains (decoupled PPO loss)."""
    streaming_rollouts: bool = False
    """With async_rollouts=true: stream prompt groups continuously instead of whole batches (AReaL's fully asynchronous
    mode): at most (max_staleness + 1) x prompts_per_step prompts in flight, each step trains on the first
    prompts_per_step complete groups to finish, none more than max_staleness steps stale (stream/* metrics)."""
    max_staleness: int = 1
    """Async mode: batch k is generated with the weights after step max(k - max_staleness, 0); 0 = on-policy.
    Streaming: a trained group started under the weights of step k - max_staleness or newer."""
    reuse_training_logprobs: bool = True
    """Skip the old-log-prob recompute when it is redundant (synchronous rollouts: one update per batch, on-policy;
    no dropout; rollout_correction none/bypass/*_tis without batch_normalize) and take them from the training
    forward, detached, as TRL and verl do; false: always recompute. See docs/packages/algorithms-grpo.md."""

    def __post_init__(self) -> None:
        TrainerConfig.__post_init__(self)  # steps, log_every, data sources: the shared checks
        # An unknown estimator is a config error, not a failure at the first step.
        if self.advantage == "gae":
            raise ValueError("advantage='gae' needs a critic's values: use `shardforge train ppo`")
        if ":" not in self.advantage and self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"unknown advantage estimator {self.advantage!r}; registered: {ADVANTAGE_ESTIMATORS.names()} "
                "(or a user's, as 'package.module:name')"
            )
        check_streaming_config(self)


def _validate(config: GRPOConfig, prompts: PromptSet, dp_size: int) -> None:
    budget = config.engine.max_tokens_per_microbatch
    check_rollout_batch(config, prompts, dp_size, budget, f"engine.max_tokens_per_microbatch={budget}")
    if config.advantage != "dr_grpo" and config.group_size < 2:
        raise ValueError(f"advantage={config.advantage!r} needs group_size >= 2 (it compares samples of a prompt)")
    if greedy_baseline(config.advantage, config.reward_shaping) is not None and config.reward_model.path is not None:
        raise ValueError(
            f"advantage={config.advantage} with reward_model is not supported yet: the greedy baseline episodes are scored by the "
            "reward functions only; use another estimator (grpo, rloo) or drop reward_model"
        )
    kl_coef = config.actor.kl_coef
    if config.kl_ctrl.kl_coef not in (0.0, kl_coef):
        raise ValueError(
            f"kl_ctrl.kl_coef={config.kl_ctrl.kl_coef} differs from actor.kl_coef={kl_coef}: GRPO's KL is in the loss; "
            "set the (initial) coefficient with actor.kl_coef only"
        )
    if config.kl_ctrl.type != "fixed" and kl_coef == 0:
        raise ValueError(
            f"kl_ctrl.type={config.kl_ctrl.type!r} steers actor.kl_coef, which is 0 (no reference model, no KL): "
            "set actor.kl_coef > 0 as the starting coefficient (e.g. 0.001 with actor.kl_estimator=k3)"
        )
    if config.max_staleness < 0:
        raise ValueError(f"max_staleness={config.max_staleness} must be >= 0 (0 = on-policy, no overlap)")
    check_partial_rollouts(config)
    check_streaming_layout(config, dp_size)
    check_async_recompute(config)
    ds_rank0 = config.rollout.engine == "vllm" and config.rollout.vllm.placement == "rank0" and dp_size > 1
    if config.dynamic_sampling.enabled and ds_rank0:
        raise ValueError(
            "dynamic_sampling with rollout.vllm.placement=rank0 and several data-parallel ranks is not supported yet (never "
            "run: rank 0's vLLM serving every rank's backfill rounds); use rollout.vllm.placement=each_rank or rollout.engine=hf"
        )
    if config.actor.behav_weight_cap is not None:
        raise ValueError(
            f"actor.behav_weight_cap={config.actor.behav_weight_cap} is not used by GRPO: the behaviour weight of "
            "every batch is rollout_correction's; e.g. AReaL's cap-5 mask is "
            "rollout_correction: {mode: token_mis, high: 5.0}, a cap-5 truncation {mode: token_tis, cap: 5.0}"
        )


class GRPOTrainer(RLTrainer[GRPOConfig]):
    """One PPO-clip update per rollout batch; batches come from a `RolloutSource` (sync, async or streaming)."""

    name = "grpo"
    advantage_stage = "group"

    def build_engines(self) -> TrainEngine:
        from shardforge.engine import TrainEngine

        config = self.config
        engine = TrainEngine(config.model, config.layout, with_total_steps(config.engine, config.steps))
        _validate(config, self.prompts, engine.dp_size)
        check_prompt_positions(config, self.prompts, engine.hf_config)
        check_eval_split(config, len(self.held_out) if self.held_out is not None else None, engine.dp_size)
        if config.temperature > 0:  # train on the distribution the rollouts sample from
            engine.logprob_temperature = config.temperature
        self.reward_model = build_reward_model(config, engine)
        self.reference = build_reference(config, config.actor.kl_coef > 0)  # the KL term of the actor loss
        return engine

    def kl_coefficient(self) -> float:
        return self.config.actor.kl_coef

    def setup(self, start: int, restored: dict[str, Any]) -> None:
        config, engine = self.config, self.engine
        self.advantages = self.build_advantage_stage()
        self.build_source(
            start, restored, [engine], asynchronous=config.async_rollouts, max_staleness=config.max_staleness,
            baseline=self.advantages.baseline, streaming=config.streaming_rollouts,
        )  # fmt: skip
        self.actor = PPOActorLossFn(config.actor)
        if _reuse_training_logprobs(config, engine):
            self.actor = OnPolicyActorLossFn(config.actor, config.rollout_correction)
            log.info("old log-probs: from the training forward (one update per on-policy batch; no recompute pass)")

    def update(self, sampled: SampledBatch, metrics: StepMetrics) -> dict[str, float]:
        if self.reference is not None:  # the coefficient this step uses (the controller's, when adaptive)
            self.actor.config = dataclasses.replace(self.actor.config, kl_coef=self.kl_ctrl.value)
            metrics.put({"kl_coef": self.kl_ctrl.value})
        return _train_step(sampled, self.config, self.engine, self.actor, metrics, self.advantages, self.reference)

    def after_step(self, stats: dict[str, float]) -> None:
        if not isinstance(self.actor, OnPolicyActorLossFn) and "rollout_corr/kl_k1" not in stats:
            # Bypass: the loss's ratio pi/behav before the step is the mismatch itself (k1 of behav -> pi).
            stats["rollout_corr/kl_k1"] = stats["actor/approx_kl"]
        if self.reference is not None:
            config = self.config
            self.kl_ctrl.update(stats["actor/kl_ref"], config.prompts_per_step * config.group_size)

    def postfix(self, stats: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{stats['reward_mean']:.3f}", "len": f"{stats['response_len_mean']:.1f}"}


def run_grpo(config: GRPOConfig) -> dict[str, Any]:
    """Train; return a summary (accuracy before/after, final reward). Call on every rank."""
    return GRPOTrainer(config).run()


def _reuse_training_logprobs(config: GRPOConfig, engine: TrainEngine) -> bool:
    """Whether the old log-probs the recompute pass would give are the training forward's: one
    synchronous (on-policy) update per batch with the same weights, no dropout (train-mode forward
    = eval-mode forward), and a rollout correction that can run inside the loss."""
    mode = ROLLOUT_CORRECTIONS.get(config.rollout_correction.mode)
    return (
        config.reuse_training_logprobs
        and config.recompute_logprobs
        and getattr(mode, "recompute", True)
        and not config.async_rollouts
        and correction_fits_in_loss(config.rollout_correction)
        and not has_dropout(engine.hf_config)
    )


def _train_step(
    sampled: SampledBatch,
    config: GRPOConfig,
    engine: TrainEngine,
    actor: PPOActorLossFn,
    metrics: StepMetrics,
    stage: AdvantageStage,
    reference: TrainEngine | None = None,
) -> dict[str, float]:
    """One PPO update on a sampled batch; its statistics go to ``metrics`` (reduced once at the step's end), the
    returned dict holds the engine's own (already global) results. The trainer's recomputed log-probs anchor the
    PPO ratio (the proximal policy); the rollout correction weights every token by trainer/engine (the behaviour
    policy), for fresh batches (kernel/precision mismatch) and stale ones (async mode, decoupled PPO) alike. Bypass
    mode anchors the ratio on the engine's log-probs instead."""
    started = time.perf_counter()
    batch = trajectories_to_batch(sampled.rollouts, stage.sequence_advantages(sampled, metrics))
    if reference is not None:  # actor.kl_coef > 0: the KL term of the loss against the frozen reference
        with phase("ref_logprobs"):
            batch.extras[REF_LOGPROBS] = reference.forward(batch)
    recompute = ROLLOUT_CORRECTIONS.get(config.rollout_correction.mode).recompute
    if config.recompute_logprobs and recompute and not isinstance(actor, OnPolicyActorLossFn):
        with phase("old_logprobs"):
            batch.extras[OLD_LOGPROBS] = engine.forward(batch)
        add_behaviour_gap(metrics, behaviour_gap(batch.extras[OLD_LOGPROBS], batch.extras[BEHAVIOUR_LOGPROBS],
                                                 batch.loss_mask))  # fmt: skip
        correction = correct_batch(
            batch, config.rollout_correction, old_key=OLD_LOGPROBS, group=engine.dp_group, device=engine.device
        )
        add_correction_stats(metrics, correction)
    stage.token_advantages(batch, sampled, metrics)
    mask = batch.loss_mask != 0
    # the share of trained tokens with a learning signal (dynamic sampling drives it to 1)
    signal = {"signal": (mask & (batch.extras[ADVANTAGES] != 0)).sum(), "targets": mask.sum()}
    metrics.add("advantage", signal, _signal_view)
    forwarded = time.perf_counter()
    with phase("train"):
        stats = engine.train_batch(batch, actor, actor.loss_weight)
    add_actor_stats(metrics, actor.pop_stats())
    if isinstance(actor, OnPolicyActorLossFn):  # the correction ran inside the loss, per micro-batch
        local = actor.pop_correction_stats()
        add_behaviour_gap(metrics, {"behaviour_gap": local.pop("behaviour_gap"), "num_tokens": local["num_tokens"]})
        add_correction_stats(metrics, local)
    metrics.put({
        "rollout_version": float(sampled.rollouts[0].version),
        "generate_s": sampled.generate_s,
        "logprob_forward_s": forwarded - started,
        "train_s": stats["step_time_s"],
    })  # fmt: skip
    add_source_stats(metrics, sampled, config)
    return stats


def _signal_view(raw: dict[str, float]) -> dict[str, float]:
    return {"advantage_nonzero_frac": raw["signal"] / max(raw["targets"], 1.0)}


TRAINER = TrainerSpec(config_cls=GRPOConfig, run=run_grpo, row_fields=RL_PROMPT_ROW_FIELDS)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
