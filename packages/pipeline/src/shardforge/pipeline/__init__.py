"""shardforge.pipeline: pipeline parallelism for HF decoders.

Split a decoder-only causal LM into stages by layers (`split_layers`, `split_decoder`),
keep global parameter names (`merge_stages`), and run packed micro-batches of one static
shape (`stack_packed_microbatches`) through a `torch.distributed.pipelining` schedule
chosen by name (`Pipeline`: GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble).
"""

from shardforge.pipeline.layout import balanced_layers_per_stage, split_layers, stage_ids_for_rank
from shardforge.pipeline.microbatch import StackedMicrobatches, stack_packed_microbatches, trim_cu_seqlens
from shardforge.pipeline.schedule import (
    SCHEDULES,
    MicrobatchLossFn,
    Pipeline,
    ScheduleSpec,
    resolve_schedule,
    valid_num_microbatches,
)
from shardforge.pipeline.stage import DecoderStage, LayerKwargsFn, OutputFn, merge_stages, split_decoder

__version__ = "0.1.0"

__all__ = [
    "SCHEDULES",
    "DecoderStage",
    "LayerKwargsFn",
    "MicrobatchLossFn",
    "OutputFn",
    "Pipeline",
    "ScheduleSpec",
    "StackedMicrobatches",
    "balanced_layers_per_stage",
    "merge_stages",
    "resolve_schedule",
    "split_decoder",
    "split_layers",
    "stack_packed_microbatches",
    "stage_ids_for_rank",
    "trim_cu_seqlens",
    "valid_num_microbatches",
]
