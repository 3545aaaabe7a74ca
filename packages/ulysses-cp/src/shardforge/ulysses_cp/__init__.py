"""shardforge.ulysses_cp: packed-sequence (cu_seqlens) attention and Ulysses context parallelism."""

from shardforge.ulysses_cp.all_to_all import head_to_seq, seq_to_head
from shardforge.ulysses_cp.packed_attention import (
    CP_GROUP_KWARG,
    PACKED_ATTENTION,
    packed_attention_forward,
    packed_model_kwargs,
    packed_sdpa,
    register_packed_attention,
)
from shardforge.ulysses_cp.sharding import gather_sequence, pad_length, slice_for_rank
from shardforge.ulysses_cp.validate import valid_cp_sizes, validate_cp

__version__ = "0.1.0"

__all__ = [
    "CP_GROUP_KWARG",
    "PACKED_ATTENTION",
    "gather_sequence",
    "head_to_seq",
    "packed_attention_forward",
    "packed_model_kwargs",
    "packed_sdpa",
    "pad_length",
    "register_packed_attention",
    "seq_to_head",
    "slice_for_rank",
    "valid_cp_sizes",
    "validate_cp",
]
