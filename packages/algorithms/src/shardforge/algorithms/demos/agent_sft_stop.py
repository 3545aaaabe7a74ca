"""The agent demo's SFT stop rule: train until greedy validation success reaches a target, with a cap.

Whether the tiny model learns to copy the calculator's answer is a sharp transition that lands at a
different SFT step per seed (README, "The agent demo": 130 steps gave 14% and 0.75% held-out success
on seeds 0 and 1, 240 steps 97% and 94%). GRPO gains only from a model left part way, so the demo
does not fix the step count: it trains in chunks of ``check_every`` steps (one SFT run resumed from
its checkpoint, so the chunks reproduce one uninterrupted run whose cosine schedule spans
``max_steps``), measures greedy tool_use success on a validation split (``val.jsonl``, disjoint from
the held-out prompts that the demo reports) through ``shardforge eval`` after each chunk, and stops
at the first check with success >= ``target``. A check above ``high`` overshot the band (the model
jumped past it within one chunk; measured: 12% -> 82% and 0% -> 70% between steps 120 and 140): the
rule then rewinds once to the previous check's checkpoint and checks every ``fine_every`` steps up
to the overshooting step, stopping at the first of those >= ``target``. A stop still above ``high``
is reported as an overshoot, and reaching ``max_steps`` below ``target`` with a warning; the demo
goes on to GRPO in both cases. Settings: ``demo_agent_sft_stop.yaml``, CLI ``--sft-stop``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SFTStopResult", "SFTStopRule", "train_until_success"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SFTStopRule:
    """When the agent demo's SFT stage stops (YAML keys mirror the field names)."""

    target: float = 0.2
    """Stop at the first check whose greedy validation success@1 is >= this (a fraction in (0, 1])."""
    high: float = 0.5
    """Upper end of the wanted band: a stop above it is reported as an overshoot (>= target, <= 1)."""
    first_check: int = 60
    """SFT step of the first check (>= 1)."""
    check_every: int = 20
    """Steps between checks after the first (>= 1)."""
    fine_every: int = 5
    """Steps between checks after an overshoot, from the previous check (1 <= fine_every <= check_every)."""
    max_steps: int = 300
    """Cap on SFT steps (>= first_check); also the length of the SFT cosine schedule."""
    val_prompts: int = 100
    """Validation prompts (a split of their own, never the held-out ones) evaluated at each check (>= 1)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"sft stop target={self.target} is invalid; use a success fraction in (0, 1], e.g. 0.2")
        if not self.target <= self.high <= 1.0:
            raise ValueError(f"sft stop high={self.high} is invalid; use a fraction in [target={self.target}, 1]")
        for name in ("first_check", "check_every", "val_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft stop {name}={getattr(self, name)} is invalid; it must be >= 1")
        if not 1 <= self.fine_every <= self.check_every:
            raise ValueError(
                f"sft stop fine_every={self.fine_every} is invalid; use 1 <= fine_every <= check_every={self.check_every}"
            )
        if self.max_steps < self.first_check:
            raise ValueError(
                f"sft stop max_steps={self.max_steps} is invalid; it must be >= first_check={self.first_check}"
            )

    def check_steps(self) -> list[int]:
        """The SFT steps at which success is measured: first_check, then every check_every, and max_steps."""
        steps = list(range(self.first_check, self.max_steps, self.check_every))
        return [*steps, self.max_steps]


@dataclass(frozen=True, slots=True)
class SFTStopResult:
    """Where SFT stopped and why."""

    steps: int
    success: float
    reason: str
    """"target" (success >= target), "overshoot" (success > high) or "max_steps" (cap, below target)."""
    checks: list[tuple[int, float]] = field(default_factory=list)
    """(step, validation success) of every check, in order."""

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "success": self.success, "reason": self.reason, "checks": self.checks}


def train_until_success(
    rule: SFTStopRule,
    train_to: Callable[[int], None],
    success_at: Callable[[int], float],
    rewind: Callable[[int], None] | None = None,
) -> SFTStopResult:
    """Call ``train_to(step)`` (train up to that SFT step from the newest checkpoint) and
    ``success_at(step)`` (validation success of the model at that step) for each of
    ``rule.check_steps()`` until success >= ``rule.target``. On the first overshoot (> ``rule.high``),
    ``rewind(step)`` (drop the checkpoints after ``step``) goes back to the previous check, whose
    checkpoint the caller keeps, and the checks between go ``rule.fine_every`` apart."""
    checks: list[tuple[int, float]] = []
    pending, previous, refined = rule.check_steps(), 0, False
    while pending:
        step = pending.pop(0)
        train_to(step)
        success = success_at(step)
        checks.append((step, success))
        logger.info(f"SFT step {step}: validation success {success:.1%} (target {rule.target:.0%})")
        if success < rule.target:
            previous = step
            continue
        if success > rule.high and not refined and rewind is not None and 0 < previous < step - rule.fine_every:
            refined = True
            logger.info(
                f"SFT overshot the band ({success:.1%} > high={rule.high:.0%} at step {step}): back to step "
                f"{previous}, checking every {rule.fine_every} steps"
            )
            rewind(previous)
            pending = [*range(previous + rule.fine_every, step, rule.fine_every), step, *pending]
            continue
        if success > rule.high:
            logger.warning(
                f"SFT overshot the band: {success:.1%} > high={rule.high:.0%} at its first check above "
                f"target={rule.target:.0%} (step {step}); a smaller check_every stops closer to the target"
            )
            return SFTStopResult(step, success, "overshoot", checks)
        return SFTStopResult(step, success, "target", checks)
    logger.warning(
        f"SFT reached max_steps={rule.max_steps} with validation success {checks[-1][1]:.1%} < "
        f"target={rule.target:.0%}; GRPO starts from it anyway (raise max_steps to train longer)"
    )
    return SFTStopResult(rule.max_steps, checks[-1][1], "max_steps", checks)
