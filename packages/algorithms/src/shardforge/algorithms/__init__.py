"""shardforge.algorithms: packed batches, the training engine, losses and trainers.

The names below are imported on first use (PEP 562): ``python -m shardforge.algorithms.cli`` runs
this file first, and the launching `shardforge` process (config checks, then torchrun's agent) must
not pay for the engine's imports (DTensor, FSDP, transformers) that only the ranks need.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from shardforge.algorithms.batching import PackedBatch, ffd_bins, pack_sequences, split_microbatches
    from shardforge.algorithms.engine import LossFn, LossWeightFn, TrainEngine
    from shardforge.algorithms.engine.config import EngineConfig, OptimizerConfig, SchedulerConfig, parse_dtype
    from shardforge.algorithms.objectives.sft import sft_loss, target_logprobs, token_count

__version__ = "0.1.0"

_LAZY = {
    "EngineConfig": "shardforge.algorithms.engine.config",
    "LossFn": "shardforge.algorithms.engine",
    "LossWeightFn": "shardforge.algorithms.engine",
    "OptimizerConfig": "shardforge.algorithms.engine.config",
    "PackedBatch": "shardforge.algorithms.batching",
    "SchedulerConfig": "shardforge.algorithms.engine.config",
    "TrainEngine": "shardforge.algorithms.engine",
    "ffd_bins": "shardforge.algorithms.batching",
    "pack_sequences": "shardforge.algorithms.batching",
    "parse_dtype": "shardforge.algorithms.engine.config",
    "sft_loss": "shardforge.algorithms.objectives.sft",
    "split_microbatches": "shardforge.algorithms.batching",
    "target_logprobs": "shardforge.algorithms.objectives.sft",
    "token_count": "shardforge.algorithms.objectives.sft",
}

__all__ = [
    "EngineConfig",
    "LossFn",
    "LossWeightFn",
    "OptimizerConfig",
    "PackedBatch",
    "SchedulerConfig",
    "TrainEngine",
    "ffd_bins",
    "pack_sequences",
    "parse_dtype",
    "sft_loss",
    "split_microbatches",
    "target_logprobs",
    "token_count",
]


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
