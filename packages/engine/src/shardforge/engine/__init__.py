"""shardforge.engine: packed batches, objectives and the training engine for HF models.

- `shardforge.engine.batching`: `PackedBatch`, packing, token-budget micro-batches, target alignment, prefix sharing;
- `shardforge.engine.objectives`: pure tensor math with registries (SFT, policy losses, advantage estimators, KL,
  aggregation, rollout correction, preference, distillation);
- `TrainEngine` (``train_batch``, ``forward``, ``eval_batch``, ``save``/``load``, ``export_hf``, ``publish_weights``):
  THE composition order of the parallelisms is written once, in `shardforge.engine.build.build_model`
  (docs/parallelism.md).

`TrainEngine` is imported on first use (PEP 562): a process that only reads the config dataclasses
(``engine.config``, the launching ``shardforge`` command) and the layout checks does not pay for the engine's
FSDP/DTensor imports.
"""

import importlib as _importlib
import typing as _typing

from shardforge.engine.batching import PackedBatch, ffd_bins, pack_sequences, split_microbatches
from shardforge.engine.config import EngineConfig, OptimizerConfig, SchedulerConfig, parse_dtype

if _typing.TYPE_CHECKING:
    from shardforge.engine.objectives.sft import sft_loss, target_logprobs, token_count
    from shardforge.engine.train_engine import LossFn, LossWeightFn, TrainEngine

__version__ = "0.1.0"

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

_LAZY = {
    **dict.fromkeys(("LossFn", "LossWeightFn", "TrainEngine"), "shardforge.engine.train_engine"),
    **dict.fromkeys(("sft_loss", "target_logprobs", "token_count"), "shardforge.engine.objectives.sft"),
}


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
