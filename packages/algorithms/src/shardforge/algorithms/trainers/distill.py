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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from shardforge.algorithms.batching import PackedBatch
from shardforge.algorithms.batching.collectives import all_reduce_sum
from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS
from shardforge.algorithms.rlvr import PROMPT_ROW_FIELDS, AdvantageEstimator
from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.grpo import GRPOConfig, GRPOTrainer

__all__ = ["DistillConfig", "DistillTrainer", "distill_advantages", "run_distill"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DistillConfig(GRPOConfig):
    """Everything `shardforge train distill` needs: GRPO's fields plus the teacher (shared fields: `GRPOConfig`)."""

    teacher_model: str
    """Frozen teacher HF model directory (same tokenizer / vocabulary as the student)."""
    group_size: int = 1
    """Samples per prompt (1 is enough for pure distillation; >= 2 to mix a task reward with grpo)."""
    advantage: AdvantageEstimator = "dr_grpo"
    """Outcome estimator for the task-reward term (task_reward_coef > 0)."""
    distill_coef: float = 1.0
    """Weight of the per-token reverse-KL advantage (teacher - student log-prob)."""
    task_reward_coef: float = 0.0
    """Weight of the outcome-reward advantage (0 = pure distillation)."""
    offload_teacher: bool = False
    """Keep the teacher's weights in host memory except during its forward (an accelerator memory saver)."""

    def __post_init__(self) -> None:
        GRPOConfig.__post_init__(self)
        if self.distill_coef < 0 or self.task_reward_coef < 0 or self.distill_coef + self.task_reward_coef == 0:
            raise ValueError(
                f"distill_coef={self.distill_coef} and task_reward_coef={self.task_reward_coef} must be >= 0 and not "
                "both 0 (distill_coef=1, task_reward_coef=0 is pure on-policy distillation)"
            )


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
    """GRPO's loop with the teacher's per-token reverse KL as the advantage."""

    name = "distill"

    def build_engines(self) -> TrainEngine:
        config = self.config
        assert isinstance(config, DistillConfig)
        engine = super().build_engines()
        teacher_config = config.engine
        if config.offload_teacher:
            teacher_config = dataclasses.replace(teacher_config, offload_when_idle=True, cpu_offload=False)
        self.teacher = TrainEngine(config.teacher_model, config.layout, teacher_config)
        if self.teacher.hf_config.vocab_size != engine.hf_config.vocab_size:
            raise ValueError(
                f"teacher_model vocabulary ({self.teacher.hf_config.vocab_size}) differs from the student's "
                f"({engine.hf_config.vocab_size}); on-policy distillation scores the student's tokens with the teacher, "
                "so both must share one tokenizer"
            )
        if config.temperature > 0:
            self.teacher.logprob_temperature = config.temperature
        self.advantage_hook = self._distill_hook
        return engine

    def _distill_hook(self, batch: PackedBatch) -> dict[str, float]:
        config = self.config
        assert isinstance(config, DistillConfig)
        teacher = self.teacher.forward(batch)
        advantages, reverse_kl = distill_advantages(
            batch, teacher, distill_coef=config.distill_coef, task_reward_coef=config.task_reward_coef
        )
        batch.extras[ADVANTAGES] = advantages
        mask = batch.loss_mask != 0
        kl_sum, teacher_sum, count = all_reduce_sum(
            reverse_kl.double().sum(), teacher.double()[mask].sum(), mask.sum(),
            group=self.engine.dp_group, device=self.engine.device,
        )  # fmt: skip
        return {
            "distill/reverse_kl": kl_sum / max(count, 1.0),
            "distill/teacher_logprob": teacher_sum / max(count, 1.0),
        }


def run_distill(config: DistillConfig) -> dict[str, Any]:
    """Distil the teacher into the student on the student's own samples; return a summary. Call on every rank."""
    return DistillTrainer(config).run()


TRAINER = TrainerSpec(config_cls=DistillConfig, run=run_distill, row_fields=PROMPT_ROW_FIELDS)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
