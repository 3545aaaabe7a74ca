"""shardforge.ulysses_cp: packed-sequence attention (cp = 1). Ulysses context parallelism is planned."""

from shardforge.ulysses_cp.packed_attention import (
    PACKED_ATTENTION,
    packed_attention_forward,
    packed_model_kwargs,
    packed_sdpa,
    register_packed_attention,
)

__version__ = "0.1.0"

__all__ = [
    "PACKED_ATTENTION",
    "packed_attention_forward",
    "packed_model_kwargs",
    "packed_sdpa",
    "register_packed_attention",
]
