"""Training data: SFT rows, preference pairs and the deterministic global batch sampler."""

from shardforge.algorithms.data.preference import (
    IS_CHOSEN,
    PAIR_ROW_FIELDS,
    PAIR_WEIGHT,
    PreferencePair,
    load_pairs,
    pack_pairs,
)
from shardforge.algorithms.data.sampler import GlobalBatchSampler
from shardforge.algorithms.data.sft import (
    SFT_ROW_FIELDS,
    SFTExample,
    load_sft_examples,
    pack_examples,
    tokenize_sft_row,
)

__all__ = [
    "IS_CHOSEN",
    "PAIR_ROW_FIELDS",
    "PAIR_WEIGHT",
    "SFT_ROW_FIELDS",
    "GlobalBatchSampler",
    "PreferencePair",
    "SFTExample",
    "load_pairs",
    "load_sft_examples",
    "pack_examples",
    "pack_pairs",
    "tokenize_sft_row",
]
