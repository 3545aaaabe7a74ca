"""`shardforge plan`: predict per-rank peak memory of every valid layout and rank those that fit.

See docs/planner.md for the memory model (every formula) and its validation against
measured peaks on CPU.
"""

from shardforge.algorithms.plan.layouts import PlanResult, enumerate_layouts, plan_layouts, validate_for_engine
from shardforge.algorithms.plan.memory import MemoryEstimate, estimate_memory
from shardforge.algorithms.plan.options import PlanOptions, parse_memory
from shardforge.algorithms.plan.presets import PRESETS, load_model_config
from shardforge.algorithms.plan.stats import ModelStats, model_stats

__all__ = [
    "PRESETS",
    "MemoryEstimate",
    "ModelStats",
    "PlanOptions",
    "PlanResult",
    "enumerate_layouts",
    "estimate_memory",
    "load_model_config",
    "model_stats",
    "parse_memory",
    "plan_layouts",
    "validate_for_engine",
]
