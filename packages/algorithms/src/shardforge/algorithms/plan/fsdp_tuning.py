"""FSDP settings for a planned layout: the fastest measured tuning that still fits the budget.

`benchmarks/bench_fsdp_tuning.py` measured each engine knob against the default (d2 SFT of the demo
model, 2-core AMD EPYC, gloo; identical losses): forward prefetch of one unit x1.24, two layers per
FSDP unit x1.18, no reshard after forward x1.10 (all three together x1.21, no better than prefetch
alone). Each costs memory: prefetch and bigger units hold more gathered parameters at once, no
reshard keeps every unit gathered from forward to backward. `suggest_fsdp` re-estimates the layout
with each setting, fastest first, and returns the first whose peak fits; on a GPU with NCCL the gains
have not been measured (issue 23), so the ranking is the CPU one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardforge.algorithms.plan.memory import MemoryEstimate, estimate_memory
from shardforge.algorithms.plan.options import PlanOptions
from shardforge.algorithms.plan.shards import shard_plan
from shardforge.algorithms.plan.stats import ModelStats

__all__ = ["TUNINGS", "FSDPSuggestion", "suggest_fsdp"]

TUNINGS: tuple[tuple[dict[str, Any], str], ...] = (
    ({"fsdp_forward_prefetch": 1}, "x1.24"),
    ({"fsdp_layers_per_unit": 2}, "x1.18"),
    ({"reshard_after_forward": False}, "x1.10"),
)
"""(PlanOptions / engine overrides, measured step-speed gain on CPU), fastest first."""


@dataclass(frozen=True, slots=True)
class FSDPSuggestion:
    """Engine overrides for a layout, the measured gain, and the peak they are predicted to need."""

    overrides: dict[str, Any]
    gain: str
    estimate: MemoryEstimate
    extra_bytes: int

    def cli(self) -> str:
        """The overrides as CLI arguments (``engine.fsdp_forward_prefetch=1``)."""
        return " ".join(f"engine.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.overrides.items())

    def as_dict(self) -> dict[str, Any]:
        return {"overrides": dict(self.overrides), "gain": self.gain, "total": self.estimate.total,
                "extra_bytes": self.extra_bytes}  # fmt: skip


def _uses_fsdp(stats: ModelStats, est: MemoryEstimate) -> bool:
    """FSDP wraps units that reshard (not DDP, not pipeline stages, which keep their units gathered)."""
    return est.data_parallel != "ddp" and est.dims.pp == 1 and shard_plan(stats, est.dims).fsdp


def suggest_fsdp(
    stats: ModelStats, est: MemoryEstimate, opts: PlanOptions, budget: int | None
) -> FSDPSuggestion | None:
    """The fastest FSDP tuning of ``est``'s layout whose predicted peak fits ``budget`` (None: no budget),
    or None when the layout runs no FSDP (DDP, a single rank, pipeline stages that keep units gathered)
    or the user already set these knobs (anything but the defaults)."""
    if not _uses_fsdp(stats, est):
        return None
    if (opts.fsdp_forward_prefetch, opts.fsdp_layers_per_unit, opts.reshard_after_forward) != (0, 1, True):
        return None
    for overrides, gain in TUNINGS:
        tuned = estimate_memory(stats, est.dims, replace(opts, **overrides))
        if budget is None or tuned.total <= budget:
            return FSDPSuggestion(dict(overrides), gain, tuned, tuned.total - est.total)
    return None
