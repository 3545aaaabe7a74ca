"""Trainers behind one CLI, looked up by name (`shardforge train <name>`).

Each trainer module defines ``TRAINER = TrainerSpec(config_cls=..., run=...)``; it is registered
here by import path so that looking one trainer up imports only that trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardforge.core.registry import Registry

__all__ = ["TRAINERS", "TrainerSpec"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerSpec:
    """What the CLI needs to run a trainer."""

    config_cls: type[Any]
    """The frozen config dataclass the YAML is built into."""
    run: Callable[[Any], dict[str, Any]]
    """Train on every rank; return the run summary."""
    row_fields: tuple[tuple[str, ...], ...] = ()
    """The JSONL row shapes of train_file/eval_file, checked before launch (``()``: any JSON object)."""


TRAINERS: Registry[TrainerSpec] = Registry("trainer")
TRAINERS.register_lazy(
    "sft", "shardforge.algorithms.trainers.sft:TRAINER", "supervised fine-tuning on prompt/completion or chat rows"
)
TRAINERS.register_lazy(
    "rm", "shardforge.algorithms.trainers.rm:TRAINER", "Bradley-Terry reward model on preference pairs"
)
TRAINERS.register_lazy(
    "ppo", "shardforge.algorithms.trainers.ppo:TRAINER", "PPO with a learned critic (GAE) on verifiable rewards"
)
TRAINERS.register_lazy(
    "grpo", "shardforge.algorithms.trainers.grpo:TRAINER", "GRPO / Dr. GRPO / RLOO on verifiable rewards"
)
TRAINERS.register_lazy(
    "dpo", "shardforge.algorithms.trainers.dpo:TRAINER", "DPO / IPO / hinge / SimPO on preference pairs"
)
TRAINERS.register_lazy(
    "distill",
    "shardforge.algorithms.trainers.distill:TRAINER",
    "on-policy distillation: teacher's per-token reverse KL",
)
