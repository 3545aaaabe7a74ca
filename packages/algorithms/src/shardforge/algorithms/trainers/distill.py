"""On-policy distillation: `shardforge train distill`.

The student samples responses (the GRPO machinery: rollout engine, workflows, weight sync), a frozen
teacher (same tokenizer; larger or differently trained) scores the student's tokens, and the per-token
reverse KL ``log pi_student(y_t) - log pi_teacher(y_t)`` of each sampled token becomes its (negative)
advantage (Agarwal et al. 2024 "On-Policy Distillation of Language Models" (GKD, reverse KL);
Thinking Machines' "On-Policy Distillation", 2025)::

    A_t = distill_coef * (log pi_teacher(y_t) - log pi_student(y_t)) + task_reward_coef * A_task

The student's log-prob is the one the update's ratio is anchored on (the recomputed old log-prob, or
the sampling one when the recompute is skipped). ``task_reward_coef > 0`` mixes in the run's
outcome reward through the GRPO estimator (KDRL-style; needs group_size >= 2 unless
``advantage: dr_grpo``). The PPO-clip loss, rollout correction, evaluation and checkpoints are GRPO's.
Metrics: ``distill/reverse_kl`` (per-token mean over the global batch), ``distill/teacher_logprob``.

``distill_loss`` other than ``token_reverse_kl`` replaces that single-sample advantage by an exact
per-position divergence over the whole vocabulary (GKD's full-distribution form; `DIVERGENCES`:
``full_reverse_kl``, ``full_forward_kl``, ``jsd`` with TRL's ``beta``) on the student's own samples:
the teacher's [T, V] log-probs (float32, response rows only, or its top ``teacher_top_k`` tokens plus a
tail bucket) travel in the packed batch and the loss differentiates through the student's whole
distribution, ``distill_coef * D_t`` per target, aggregated like the actor loss; a task reward still
enters through the PPO term's advantages. Metric: ``distill/<distill_loss>`` (per-token mean).

``mode: off_policy`` is supervised (sequence-level) distillation on the teacher's samples (Kim & Rush
2016, "Sequence-Level Knowledge Distillation"): the teacher generates (on its own rollout engine, ``teacher_engine``: the embedded HF
engine or vLLM with the run's ``vllm:`` options; it never receives the student's weights) and the student minimises its negative log-likelihood
of the teacher's tokens, ``-mean_t log pi_student(y_t)`` (token-mean; GPG's ``-A log pi`` with
``A = 1``). No teacher forward runs in the trainer; the student's own rollout engine only serves
evaluation. ``distill/teacher_logprob`` is then the teacher's sampling log-prob of its tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from shardforge.algorithms.data.prompts import PROMPT_ROW_FIELDS
from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.grpo import GRPOConfig, GRPOTrainer
from shardforge.algorithms.trainers.rl.advantages import ADVANTAGE_STAGES, GroupAdvantages, greedy_baseline
from shardforge.algorithms.trainers.rl.metrics import StepMetrics, means_of
from shardforge.algorithms.trainers.rl.sources import SampledBatch
from shardforge.engine.batching import PackedBatch
from shardforge.engine.loading import load_hf_config
from shardforge.engine.objectives.advantages import AdvantageEstimator
from shardforge.engine.objectives.distillation import (
    DIVERGENCES,
    TEACHER_LOGPROBS,
    TEACHER_TOKEN_IDS,
    DistributionDistillTerm,
    FullDistillActorLossFn,
    FullDistillOnPolicyActorLossFn,
)
from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS
from shardforge.engine.objectives.on_policy import OnPolicyActorLossFn
from shardforge.engine.objectives.rollout_correction import RolloutCorrectionConfig
from shardforge.mesh.collectives import all_reduce_sum
from shardforge.rollout.factory import PublishedRolloutEngine, build_rollout_engine

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    from shardforge.engine import TrainEngine

__all__ = ["DistillConfig", "DistillTrainer", "distill_advantages", "run_distill"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DistillConfig(GRPOConfig):
    """Everything `shardforge train distill` needs: GRPO's fields plus the teacher (shared fields: `GRPOConfig`)."""

    teacher_model: str
    """Frozen teacher HF model directory (same tokenizer / vocabulary as the student)."""
    mode: Literal["on_policy", "off_policy"] = "on_policy"
    """on_policy: the student samples, the teacher scores (reverse KL). off_policy: the teacher samples,
    the student learns its tokens by NLL (sequence-level KD; needs rollout.engine=hf)."""
    group_size: int = 1
    """Samples per prompt (1 is enough for pure distillation; >= 2 to mix a task reward with grpo)."""
    advantage: AdvantageEstimator = "dr_grpo"
    """Outcome estimator for the task-reward term (task_reward_coef > 0)."""
    distill_coef: float = 1.0
    """Weight of the distillation signal (the per-token reverse-KL advantage, or the full-distribution loss term)."""
    distill_loss: Literal["token_reverse_kl", "full_reverse_kl", "full_forward_kl", "jsd"] = "token_reverse_kl"
    """on_policy: token_reverse_kl = the sampled token's log-ratio as a PPO advantage (single-sample estimate);
    full_reverse_kl / full_forward_kl / jsd = the exact per-position divergence over the vocabulary in the loss
    (GKD; the teacher's [T, V] log-probs travel with the batch)."""
    beta: float = 0.5
    """distill_loss=jsd: the teacher's weight in the mixture (TRL GKD's beta: 0 = forward KL, 1 = reverse KL)."""
    teacher_top_k: int = 0
    """Full-distribution losses: keep the teacher's k most likely tokens per position plus one tail bucket
    (memory T x k instead of T x V); 0 = the whole vocabulary (exact)."""
    task_reward_coef: float = 0.0
    """Weight of the outcome-reward advantage (0 = pure distillation)."""
    kl_baseline: Literal["none", "mean"] = "none"
    """on_policy: subtract the global batch's mean per-token reverse KL from every token's (a constant
    baseline: the gradient's expectation is unchanged, its variance smaller); none = the raw estimate."""
    offload_teacher: bool = False
    """Keep the teacher's weights in host memory except during its forward (an accelerator memory saver)."""
    teacher_engine: str = "hf"
    """off_policy: the engine the teacher samples on, "hf" (embedded) or "vllm" (with the other ``rollout.*``
    options, e.g. ``rollout.vllm``; the student's own engine, ``rollout.engine``, stays "hf" and only serves
    evaluation)."""

    def __post_init__(self) -> None:
        GRPOConfig.__post_init__(self)
        if self.distill_coef < 0 or self.task_reward_coef < 0 or self.distill_coef + self.task_reward_coef == 0:
            raise ValueError(
                f"distill_coef={self.distill_coef} and task_reward_coef={self.task_reward_coef} must be >= 0 and not "
                "both 0 (distill_coef=1, task_reward_coef=0 is pure on-policy distillation)"
            )
        _check_distill_loss(self)
        if self.mode == "off_policy":
            _check_off_policy(self)
        elif self.teacher_engine != "hf":
            raise ValueError(
                f"teacher_engine={self.teacher_engine!r} samples with the teacher, which only mode=off_policy does "
                "(on_policy: the student samples and the teacher scores in the trainer); use mode=off_policy or "
                "teacher_engine=hf"
            )


def _check_distill_loss(config: DistillConfig) -> None:
    """Refuse full-distribution settings that cannot apply (the layout and mode rules of those losses)."""
    from shardforge.mesh import ParallelDims

    if config.distill_loss == "token_reverse_kl":
        if config.teacher_top_k:
            raise ValueError(f"teacher_top_k={config.teacher_top_k} needs a full-distribution distill_loss "
                             f"({', '.join(DIVERGENCES.names())}); token_reverse_kl reads one log-prob per token")  # fmt: skip
        return
    problems = []
    if config.mode != "on_policy":
        problems.append(f"mode={config.mode!r} (use mode=on_policy: the teacher scores the student's samples)")
    if config.kl_baseline != "none":
        problems.append(f"kl_baseline={config.kl_baseline!r} (a baseline for the single-sample advantage only)")
    if not 0.0 <= config.beta <= 1.0:
        problems.append(f"beta={config.beta} (must be in [0, 1])")
    if config.teacher_top_k < 0:
        problems.append(f"teacher_top_k={config.teacher_top_k} (>= 0; 0 = the whole vocabulary)")
    dims = ParallelDims.parse(config.layout)
    if dims.tp > 1 or dims.pp > 1:
        problems.append(f"layout={config.layout!r} with tp={dims.tp}, pp={dims.pp} (the loss needs the whole "
                        "vocabulary and model on each rank: FSDP/HSDP/CP layouts)")  # fmt: skip
    if problems:
        raise ValueError(f"distill_loss={config.distill_loss!r} does not take " + "; ".join(problems))


def _check_off_policy(config: DistillConfig) -> None:
    """Refuse what off-policy distillation cannot use; pin the loss (GPG with A=1 = NLL) and no correction."""
    problems = []
    if config.task_reward_coef > 0:
        problems.append(f"task_reward_coef={config.task_reward_coef} (the samples are the teacher's: no task reward)")
    if config.async_rollouts:
        problems.append("async_rollouts=true (the teacher's samples never go stale)")
    if config.rollout.engine != "hf":
        problems.append(
            f"rollout.engine={config.rollout.engine!r} (the student's engine only evaluates; to sample the teacher "
            "on vLLM set teacher_engine=vllm)"
        )
    if config.rollout_correction.mode not in ("token_tis", "none"):  # token_tis: the RL default, not a user choice
        problems.append(
            f"rollout_correction.mode={config.rollout_correction.mode!r} (teacher samples are not a behaviour policy to correct for)"
        )
    if config.actor.policy_loss not in ("vanilla", "gpg"):
        problems.append(f"actor.policy_loss={config.actor.policy_loss!r} (the loss is the student's NLL)")
    if problems:
        raise ValueError("mode=off_policy does not take " + "; ".join(problems) + "; drop them or use mode=on_policy")
    # frozen dataclass: the two settings the mode fixes, written once so config.json shows what runs
    object.__setattr__(config, "rollout_correction", RolloutCorrectionConfig(mode="none"))
    object.__setattr__(config, "actor", dataclasses.replace(config.actor, policy_loss="gpg"))


@torch.no_grad()
def distill_advantages(
    batch: PackedBatch, teacher_logprobs: torch.Tensor, *, distill_coef: float, task_reward_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] advantages ``distill_coef * (teacher - student) + task_reward_coef * A_task`` on target tokens
    (0 elsewhere), and the [T] per-token reverse KL estimate ``student - teacher`` (0 off the mask)."""
    mask = batch.loss_mask != 0
    student = batch.extras[OLD_LOGPROBS].to(torch.float32)
    reverse_kl = torch.where(mask, student - teacher_logprobs.to(torch.float32), torch.zeros_like(student))
    task = batch.extras[ADVANTAGES].to(torch.float32)
    advantages = torch.where(mask, -distill_coef * reverse_kl + task_reward_coef * task, torch.zeros_like(task))
    return advantages, reverse_kl


class DistillTrainer(GRPOTrainer):
    """GRPO's loop with the teacher's per-token reverse KL as the advantage (off_policy: NLL on its samples)."""

    name = "distill"

    def build_engines(self) -> TrainEngine:
        config = self.config
        assert isinstance(config, DistillConfig)
        engine = super().build_engines()
        if config.mode == "off_policy":
            vocab = load_hf_config(config.teacher_model).vocab_size
            _check_vocab(vocab, engine.hf_config.vocab_size)
            return engine
        teacher_config = config.engine
        if config.offload_teacher:
            teacher_config = dataclasses.replace(teacher_config, offload_when_idle=True, cpu_offload=False)
        from shardforge.engine import TrainEngine

        self.teacher = TrainEngine(config.teacher_model, config.layout, teacher_config)
        _check_vocab(self.teacher.hf_config.vocab_size, engine.hf_config.vocab_size)
        if config.temperature > 0:
            self.teacher.logprob_temperature = config.temperature
        if 0 < config.teacher_top_k and config.teacher_top_k >= engine.hf_config.vocab_size:
            raise ValueError(
                f"teacher_top_k={config.teacher_top_k} keeps the whole vocabulary ({engine.hf_config.vocab_size}); "
                "set teacher_top_k=0 (exact) or a smaller k"
            )
        return engine

    def advantage_stage_name(self) -> str:
        config = self.config
        assert isinstance(config, DistillConfig)
        return "teacher_kl" if config.mode == "on_policy" else "teacher_nll"

    def setup(self, start: int, restored: dict[str, Any]) -> None:
        super().setup(start, restored)
        config = self.config
        assert isinstance(config, DistillConfig)
        if config.distill_loss == "token_reverse_kl":
            return
        # the PPO actor loss keeps the task-reward term (advantages: task_reward_coef * A_task), plus the divergence
        term = DistributionDistillTerm(divergence=config.distill_loss, beta=config.beta, coef=config.distill_coef)
        if isinstance(self.actor, OnPolicyActorLossFn):
            self.actor = FullDistillOnPolicyActorLossFn(self.actor.config, self.actor.correction, term)
        else:
            self.actor = FullDistillActorLossFn(self.actor.config, term)

    def after_step(self, stats: dict[str, float]) -> None:
        super().after_step(stats)
        config = self.config
        assert isinstance(config, DistillConfig)
        if "actor/distill_divergence" in stats:  # the loss term's per-token mean, under the loss's name
            stats[f"distill/{config.distill_loss}"] = stats.pop("actor/distill_divergence")

    def sampling_rollout(self, rollout: PublishedRolloutEngine) -> PublishedRolloutEngine:
        config = self.config
        assert isinstance(config, DistillConfig)
        if config.mode == "on_policy":
            return rollout
        # the teacher's engine follows no weights_root: it never receives the student's weights
        teacher = dataclasses.replace(config.rollout, engine=config.teacher_engine)
        self.teacher_rollout = build_rollout_engine(
            teacher, config.teacher_model, self.tokenizer, seed=config.seed,
        )  # fmt: skip
        return self.teacher_rollout

    def close(self) -> None:
        super().close()
        teacher: Any = getattr(self, "teacher_rollout", None)
        if teacher is not None and hasattr(teacher, "shutdown"):
            teacher.shutdown()


def _check_vocab(teacher: int, student: int) -> None:
    if teacher != student:
        raise ValueError(
            f"teacher_model vocabulary ({teacher}) differs from the student's ({student}); distillation compares "
            "the two models' probabilities of the same tokens, so both must share one tokenizer"
        )


@ADVANTAGE_STAGES.register("teacher_kl")
class TeacherKLAdvantages(GroupAdvantages):
    """On-policy distillation's stage: the task-reward advantage of GRPO's estimator per trajectory, then per token
    ``distill_coef * (log pi_teacher - log pi_student) + task_reward_coef * A_task`` (or, for full-distribution
    losses, the teacher's rows in the batch and the task term alone); ``distill/*`` metrics."""

    def __init__(self, config: DistillConfig, teacher: TrainEngine, policy: TrainEngine) -> None:
        super().__init__(config.advantage, config.group_size, greedy_baseline(config.advantage, config.reward_shaping))
        self.config, self.teacher, self.policy = config, teacher, policy

    @classmethod
    def from_trainer(cls, trainer: Any) -> TeacherKLAdvantages:
        return cls(trainer.config, trainer.teacher, trainer.engine)

    def token_advantages(self, batch: PackedBatch, sampled: SampledBatch, metrics: StepMetrics) -> None:
        config = self.config
        full = config.distill_loss != "token_reverse_kl"
        teacher = self._teacher_rows(batch) if full else self.teacher.forward(batch)
        advantages, reverse_kl = distill_advantages(
            batch, teacher, distill_coef=0.0 if full else config.distill_coef, task_reward_coef=config.task_reward_coef
        )  # full-distribution losses: the divergence is in the loss, the advantage carries the task reward only
        mask = batch.loss_mask != 0
        local = {"reverse_kl": reverse_kl.double().sum(), "teacher_logprob": teacher.double()[mask].sum(),
                 "num_tokens": mask.sum()}  # fmt: skip
        if config.kl_baseline == "mean":  # A_t + coef * mean_KL: only the deviation from the batch's mean pushes
            policy = self.policy  # the batch's global mean, before the update: a collective of its own
            kl_sum, count = all_reduce_sum(local["reverse_kl"], local["num_tokens"], group=policy.dp_group,
                                           device=policy.device)  # fmt: skip
            shift = config.distill_coef * kl_sum / max(count, 1.0)
            advantages = torch.where(mask, advantages + shift, advantages)
        batch.extras[ADVANTAGES] = advantages
        metrics.add("distill", local, means_of("num_tokens", prefix="distill/"))

    def _teacher_rows(self, batch: PackedBatch) -> torch.Tensor:
        """Put the teacher's per-position rows into ``batch.extras``; return its [T] log-prob of each sampled
        token (top-k: the token's bucket, i.e. the tail's log-mass when the token is outside the top k)."""
        rows, ids = self.teacher.forward_distribution(batch, top_k=self.config.teacher_top_k)
        batch.extras[TEACHER_LOGPROBS] = rows
        tokens = batch.input_ids[:, None]
        if ids is None:
            return rows.gather(1, tokens)[:, 0]
        batch.extras[TEACHER_TOKEN_IDS] = ids
        tail = torch.log(torch.clamp(1.0 - rows.exp().sum(-1), min=torch.finfo(torch.float32).tiny))
        hit = ids == tokens
        return torch.where(hit.any(-1), (rows * hit).sum(-1), tail)


def run_distill(config: DistillConfig) -> dict[str, Any]:
    """Distil the teacher into the student on the student's own samples; return a summary. Call on every rank."""
    return DistillTrainer(config).run()


TRAINER = TrainerSpec(config_cls=DistillConfig, run=run_distill, row_fields=PROMPT_ROW_FIELDS)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
