"""Training data: SFT rows, preference pairs and the deterministic global batch sampler."""

from shardforge.algorithms.data.preference import IS_CHOSEN, PAIR_WEIGHT, PreferencePair, load_pairs, pack_pairs
from shardforge.algorithms.data.sampler import GlobalBatchSampler
from shardforge.algorithms.data.sft import SFTExample, load_sft_examples, pack_examples, tokenize_sft_row

__all__ = [
    "IS_CHOSEN",
    "PAIR_WEIGHT",
    "GlobalBatchSampler",
    "PreferencePair",
    "SFTExample",
    "load_pairs",
    "load_sft_examples",
    "pack_examples",
    "pack_pairs",
    "tokenize_sft_row",
]
