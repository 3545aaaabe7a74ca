"""What every RL trainer (GRPO, PPO, distill) shares around its update: ONE place for the prompts and reward
functions, the rollout engine and its publisher, the batch source (synchronous, or asynchronous with partial
rollouts), the sampling pipeline, held-out evaluation, the KL controller's state, export and shutdown.

ONE step for every RL trainer (`train_step`): the batch from the source -> the failed-episodes agreement -> the
reward model's scores -> the trainer's `update` (advantage stage, old log-probs, rollout correction, optimizer
steps) -> the step's statistics, reduced once (`StepMetrics`) -> `after_step` (a KL controller's move) -> publish the
new weights. A trainer adds its engines (`build_engines`), its `update` and the advantage stage that fits it
(`ADVANTAGE_STAGES`: GRPO's group estimators, PPO's GAE with its critic, distillation's teacher KL). The sampling
pipeline of a batch, in order (each piece in one module)::

    workflow round (rl/sampling.workflow_round_fn: prompts -> episodes -> trajectories, ReMax's greedy baseline)
    -> dynamic sampling over rounds (rl/dynamic_sampling)    -> reward shaping (rl/sampling.make_sample_fn)
    -> the colocated phases (rl/colocate: offload / sleep)   -> the ``generate`` profiling range
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from shardforge.algorithms.trainers.base import Trainer
from shardforge.algorithms.trainers.rl.advantages import ADVANTAGE_STAGES, AdvantageStage
from shardforge.algorithms.trainers.rl.colocate import colocated_phases
from shardforge.algorithms.trainers.rl.common import RLTrainerConfig, build_reward_fn
from shardforge.algorithms.trainers.rl.data import load_prompt_data
from shardforge.algorithms.trainers.rl.dynamic_sampling import group_filter_reason
from shardforge.algorithms.trainers.rl.metrics import StepMetrics
from shardforge.algorithms.trainers.rl.model_rewards import RewardModelScorer
from shardforge.algorithms.trainers.rl.publish import build_trainer_rollout
from shardforge.algorithms.trainers.rl.sampling import (
    build_rl_workflow,
    make_sample_fn,
    workflow_groups_fn,
    workflow_round_fn,
)
from shardforge.algorithms.trainers.rl.sources import (
    AsyncRollouts,
    PublishFn,
    RolloutSource,
    SampledBatch,
    SyncRollouts,
)
from shardforge.algorithms.trainers.rl.step_stats import (
    add_counts,
    add_dynamic_sampling_stats,
    add_reward_call_stats,
    add_reward_stats,
    add_rollout_server_stats,
    add_workflow_stats,
)
from shardforge.algorithms.trainers.rl.streaming_source import StreamingSource
from shardforge.algorithms.trainers.rl.workflow_eval import evaluate_held_out
from shardforge.algorithms.trainers.rl.workflow_stats import check_failed_episodes
from shardforge.algorithms.trainers.run.profiling import phase
from shardforge.engine.objectives.kl_control import KLController, build_kl_controller
from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.factory import PublishedRolloutEngine

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    from shardforge.algorithms.trainers.rl.advantages import GreedyBaseline
    from shardforge.engine import TrainEngine

__all__ = ["RLTrainer"]

C = TypeVar("C", bound=RLTrainerConfig)


class RLTrainer(Trainer[C]):
    """The shared part of the RL trainers (see the module docstring)."""

    eval_at_start = True
    source: RolloutSource | None = None
    """Where the steps' batches come from (`build_source`)."""
    reward_model: RewardModelScorer | None = None
    """A trained reward model scoring every rollout in the loop (``reward_model:``; set by `build_engines`)."""
    advantage_stage: ClassVar[str]
    """The name in `ADVANTAGE_STAGES` of how this trainer's batches get their advantages (`advantage_stage_name`)."""

    def advantage_stage_name(self) -> str:
        """The advantage stage of this run (a subclass may choose by its config: distill's mode)."""
        return self.advantage_stage

    def build_advantage_stage(self) -> AdvantageStage:
        """The run's `AdvantageStage`: ``advantage_stage_name()`` from `ADVANTAGE_STAGES`, built for this trainer."""
        stage: AdvantageStage = ADVANTAGE_STAGES.get(self.advantage_stage_name()).from_trainer(self)
        return stage

    def token_budget(self) -> int:
        """The most tokens one trajectory may have (the trainer's micro-batch budget)."""
        return self.config.engine.max_tokens_per_microbatch

    def kl_coefficient(self) -> float:
        """The KL coefficient the KL controller starts from (GRPO: in the loss; PPO: in the reward)."""
        raise NotImplementedError

    def load_data(self) -> None:
        config = self.config
        self.prompt_data = load_prompt_data(config, self.tokenizer)
        self.prompts, self.held_out = self.prompt_data.prompts, self.prompt_data.held_out
        self.reward_fn = build_reward_fn(config)
        self.carried_reward_calls: dict[str, float] = {}  # counted before an evaluation, reported at the next step
        self.workflow = build_rl_workflow(config, self.tokenizer, self.reward_fn, self.token_budget())

    def data_state(self) -> dict[str, Any]:
        config = self.config
        return {"seed": config.seed, "prompts_per_step": config.prompts_per_step} | self.prompt_data.data_state()

    def sampling_rollout(self, rollout: PublishedRolloutEngine) -> PublishedRolloutEngine:
        """The engine the training samples come from: the policy's own (off-policy distillation: the teacher's)."""
        return rollout

    def build_source(
        self,
        start: int,
        restored: dict[str, Any],
        idle: list[TrainEngine],
        *,
        asynchronous: bool = False,
        max_staleness: int = 0,
        baseline: GreedyBaseline | None = None,
        streaming: bool = False,
    ) -> RolloutSource:
        """The rollout engine (``self.rollout``) and the batch source the steps draw from: the sampling pipeline
        of the module docstring, run synchronously (on-policy) or ``asynchronous`` (at most ``max_staleness`` steps
        stale; partial rollouts with ``rollout.partial_rollouts``), or ``streaming`` (asynchronous, group by group:
        `StreamingSource`). ``idle``: engines the colocated phases offload while generating. Also sets
        ``self.dynamic``, ``self.phases`` and ``self.kl_ctrl``."""
        config, engine = self.config, self.engine
        keep = max(2, max_staleness + 2) if asynchronous else 2  # the generator may need max_staleness-old versions
        built = build_trainer_rollout(
            config, self.tokenizer, self.out / "weights", engine, asynchronous=asynchronous, keep_versions=keep
        )
        self.rollout = built.engine
        sampler = partial(self.prompt_data.sampler, config.prompts_per_step)
        generate_round = workflow_round_fn(
            config, self.sampling_rollout(self.rollout), self.prompts, self.workflow, engine, sampler, baseline
        )
        sample_fn, self.dynamic = make_sample_fn(config, generate_round, engine)
        self.phases = colocated_phases(config, self.rollout, idle)  # before the first publish: it may sleep now
        if self.phases is not None:
            sample_fn = self.phases.wrap(sample_fn)
        sample_fn = _traced(sample_fn)  # the generate range, on whichever thread samples

        def publish(version: int | None) -> int:
            return built.publisher.publish(engine, version)

        self.kl_ctrl: KLController = build_kl_controller(
            dataclasses.replace(config.kl_ctrl, kl_coef=self.kl_coefficient())
        )
        if "kl_coef" in restored:  # an adaptive coefficient continues where the checkpoint left it
            self.kl_ctrl.value = float(restored["kl_coef"])
        if not asynchronous:
            self.source = SyncRollouts(self.rollout, sample_fn, publish)
            return self.source
        if streaming:
            self.source = self._streaming_source(start, restored, publish, max_staleness, baseline, built.chunks)
            return self.source
        if StreamingSource.checkpoint_key in restored:
            raise ValueError(
                "the checkpoint was saved by streaming rollouts (its batches mix prompts of several steps): resume with "
                "streaming_rollouts=true and the same max_staleness, or start a new run (resume=never)"
            )
        self.source = AsyncRollouts(
            rollout=self.rollout, sample_fn=sample_fn, publish_fn=publish, max_staleness=max_staleness,
            num_batches=config.steps, start=start, dp_rank=engine.dp_rank, dp_size=engine.dp_size,
            restored=restored.get("async_rollouts"), device=engine.device, chunks=built.chunks,
        )  # fmt: skip
        return self.source

    def _streaming_source(
        self,
        start: int,
        restored: dict[str, Any],
        publish: PublishFn,
        max_staleness: int,
        baseline: GreedyBaseline | None,
        chunks: ChunkedGeneration | None,
    ) -> StreamingSource:
        """The streaming source over this rank's share of every batch, group by group (`workflow_groups_fn`, with
        ReMax's greedy episodes in each group's call);
        ``chunks``: partial rollouts (the policy engine's chunked generation, which a weight update interrupts)."""
        config, engine = self.config, self.engine
        sampler = partial(self.prompt_data.sampler, config.prompts_per_step)
        rollout = self.sampling_rollout(self.rollout)
        groups_fn = workflow_groups_fn(config, rollout, self.prompts, self.workflow, engine, sampler, baseline)
        dynamic = config.dynamic_sampling
        self.dynamic = None  # streaming filters each group as it finishes (stream/filtered_*), not per batch
        return StreamingSource(
            rollout=rollout, groups_fn=_traced(groups_fn), publish_fn=publish, prompts_per_step=config.prompts_per_step,
            max_staleness=max_staleness, num_batches=config.steps, start=start, dp_rank=engine.dp_rank,
            dp_size=engine.dp_size, restored=restored.get(StreamingSource.checkpoint_key), device=engine.device,
            record_dir=self.out / "streaming", workers=config.rollout.streaming_workers,
            keep_fn=group_filter_reason if dynamic.enabled else None, max_rounds=dynamic.max_rounds,
            chunks=chunks if rollout is self.rollout else None, late_groups=config.rollout.streaming_late_groups,
        )  # fmt: skip

    def update(self, sampled: SampledBatch, metrics: StepMetrics) -> dict[str, float]:
        """The trainer's update on a sampled batch: its optimizer steps' (already global) results; everything else
        goes to ``metrics`` (reduced once, at the end of the step)."""
        raise NotImplementedError

    def after_step(self, stats: dict[str, float]) -> None:
        """After the step's statistics are reduced, before the new weights are published (default: nothing)."""

    def train_step(self, step: int) -> dict[str, float]:
        assert self.source is not None
        config, engine = self.config, self.engine
        started = time.perf_counter()
        waits = isinstance(self.source, (AsyncRollouts, StreamingSource))
        with phase("rollout_wait") if waits else contextlib.nullcontext():
            sampled = self.source.batch(step)
        metrics = StepMetrics()
        # The one agreement before the update: every rank must know whether the step may go on.
        metrics.put(check_failed_episodes(sampled.rollouts, config.workflow.max_failed_fraction, engine))
        if self.reward_model is not None:  # collective: here on every rank, not on the sampling thread
            with phase("reward_model"):
                rewards, rm_stats = self.reward_model.add_scores(sampled.rewards, sampled.rollouts)
            sampled = dataclasses.replace(sampled, rewards=rewards)
            metrics.put(rm_stats)
        stats = self.update(sampled, metrics)
        stats["tokens_per_s"] = stats["tokens"] / max(time.perf_counter() - started, 1e-9)  # rollouts + update
        lengths = torch.tensor([t.num_generated for t in sampled.rollouts], dtype=torch.float64)
        add_reward_stats(metrics, sampled.rewards.double(), lengths)
        add_workflow_stats(metrics, sampled.rollouts)
        if self.dynamic is not None:
            add_dynamic_sampling_stats(metrics, self.dynamic.pop_stats(sampled.index))
        add_reward_call_stats(metrics, self.reward_fn, carried=self.carried_reward_calls)
        self.carried_reward_calls = {}
        add_rollout_server_stats(metrics, self.rollout)
        if self.phases is not None:
            metrics.put(self.phases.pop_stats())
        stats |= metrics.reduce(engine.dp_group, engine.device)  # the step's one metrics collective
        self.after_step(stats)
        began = time.perf_counter()
        with phase("weight_sync"):
            self.source.publish(step + 1)
        stats["weight_sync_s"] = time.perf_counter() - began
        stats["step_s"] = time.perf_counter() - started  # rollouts (or the wait) + update + publish
        return stats

    def step_summary(self, stats: dict[str, float]) -> dict[str, Any]:
        return {"reward_mean": stats["reward_mean"]}

    def extra_state(self) -> dict[str, Any]:
        source: RolloutSource | None = getattr(self, "source", None)
        state = source.checkpoint_state() if source is not None else {}
        key = getattr(source, "checkpoint_key", "async_rollouts")
        extra: dict[str, Any] = {key: state} if state else {}
        if self.config.kl_ctrl.type != "fixed":
            extra["kl_coef"] = self.kl_ctrl.value
        return extra

    def evaluate(self) -> dict[str, float]:
        assert self.held_out is not None and self.source is not None
        config = self.config
        # The evaluation's reward calls are not the next step's: set the training ones aside, drop the eval's
        # (a resumed run's step metrics then equal the uninterrupted run's).
        training_calls = self.reward_fn.pop_stats()
        result = evaluate_held_out(
            self.rollout, self.held_out, self.engine, self.reward_fn, config.workflow, self.workflow,
            config.eval_sampling, config.max_new_tokens, config.eval_size, runner=self.source.evaluate,
        )  # fmt: skip
        self.reward_fn.pop_stats()
        self.carried_reward_calls = add_counts(self.carried_reward_calls, training_calls)
        return result

    def eval_summary(self, result: dict[str, float], at_start: bool) -> dict[str, Any]:
        return {"accuracy_start" if at_start else "accuracy_end": result["accuracy"]}

    def export_extra(self, summary: dict[str, Any]) -> None:
        processor = self.prompt_data.image_processor  # a VLM: AutoImageProcessor.from_pretrained(hf_dir)
        if processor is not None and self.engine.is_main and "hf_dir" in summary:
            processor.save_pretrained(summary["hf_dir"])

    def close(self) -> None:
        source: RolloutSource | None = getattr(self, "source", None)
        if source is not None:
            source.close()
        if hasattr(self, "reward_fn"):
            self.reward_fn.close()
        close_workflow = getattr(getattr(self, "workflow", None), "close", None)
        if callable(close_workflow):  # a workflow's servers (openenv's local environment servers)
            close_workflow()


A = TypeVar("A")
R = TypeVar("R")


def _traced(sample_fn: Callable[[A], R]) -> Callable[[A], R]:
    def sample(arg: A) -> R:
        with phase("generate"):
            return sample_fn(arg)

    return sample
