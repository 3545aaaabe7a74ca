"""The training engine: layout checks, THE composition order, runners, heads, I/O.

See docs/parallelism.md for the composition order (written once, in `build.build_model`).
"""

from shardforge.algorithms.engine.config import EngineConfig, OptimizerConfig, SchedulerConfig, parse_dtype
from shardforge.algorithms.engine.engine import LossFn, LossWeightFn, TrainEngine

__all__ = [
    "EngineConfig",
    "LossFn",
    "LossWeightFn",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainEngine",
    "parse_dtype",
]
