"""shardforge.algorithms: packed batches, the training engine, losses and trainers."""

from shardforge.algorithms.batching import PackedBatch, ffd_bins, pack_sequences, split_microbatches
from shardforge.algorithms.engine import LossFn, LossWeightFn, TrainEngine
from shardforge.algorithms.engine.config import EngineConfig, OptimizerConfig, SchedulerConfig, parse_dtype
from shardforge.algorithms.objectives.sft import sft_loss, target_logprobs, token_count

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
