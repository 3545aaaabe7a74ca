"""The training engine: layout checks, THE composition order, runners, heads, I/O.

See docs/parallelism.md for the composition order (written once, in `build.build_model`).
`TrainEngine` is imported on first use (PEP 562): the launching `shardforge` process reads the
config dataclasses (``engine.config``) and the layout checks without the engine's FSDP/DTensor imports.
"""

import importlib as _importlib
import typing as _typing

from shardforge.algorithms.engine.config import EngineConfig, OptimizerConfig, SchedulerConfig, parse_dtype

if _typing.TYPE_CHECKING:
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

_LAZY = {name: "shardforge.algorithms.engine.engine" for name in ("LossFn", "LossWeightFn", "TrainEngine")}


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
