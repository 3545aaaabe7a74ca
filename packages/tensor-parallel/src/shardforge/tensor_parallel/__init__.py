"""shardforge.tensor_parallel: tensor + sequence parallelism for HF decoders, and vocab-parallel losses."""

from shardforge.tensor_parallel.apply import apply_tensor_parallel
from shardforge.tensor_parallel.plans import (
    PLAN_BUILDERS,
    TPPlan,
    dense_decoder_plan,
    moe_attention_plan,
    plan_for_model,
    supported_families,
)
from shardforge.tensor_parallel.validate import valid_tp_sizes, validate_tp
from shardforge.tensor_parallel.vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)

__version__ = "0.1.0"

__all__ = [
    "PLAN_BUILDERS",
    "TPPlan",
    "apply_tensor_parallel",
    "dense_decoder_plan",
    "moe_attention_plan",
    "plan_for_model",
    "supported_families",
    "valid_tp_sizes",
    "validate_tp",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]
