"""Preference pairs (reward models, DPO): ``{"prompt", "chosen", "rejected"}`` rows (JSONL or any `data:` source), tokenised as
``<bos> prompt response <eos>`` per side and packed as consecutive (chosen, rejected) sequences with
one ``sequence_group`` id per pair, so the engine keeps a pair in one micro-batch."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.algorithms.data.config import eval_source, train_sources
from shardforge.algorithms.data.source_set import SourceSet, loader_arg
from shardforge.algorithms.data.sources import SourceConfig, read_rows
from shardforge.engine.batching import SEQUENCE_GROUP, PackedBatch, pack_sequences

__all__ = [
    "IS_CHOSEN",
    "PAIR_ROW_FIELDS",
    "PAIR_WEIGHT",
    "PreferencePair",
    "load_pair_data",
    "load_pairs",
    "pack_pairs",
]

IS_CHOSEN = "is_chosen"
"""Per-sequence [N] extra: 1 for a chosen response, 0 for a rejected one (pairs are consecutive)."""
PAIR_ROW_FIELDS = (("prompt", "chosen", "rejected"),)
"""The row shape of a preference file (see `shardforge.algorithms.data.jsonl.RowFields`)."""
PAIR_WEIGHT = "pair_weight"
"""Per-sequence [N] extra: 1, or 0 for a placeholder pair that must not count."""


@dataclass(frozen=True, slots=True)
class PreferencePair:
    """Token ids of the chosen and the rejected sequence (prompt + response each)."""

    chosen: list[int]
    rejected: list[int]
    chosen_prompt_len: int = 0
    """Leading prompt tokens of ``chosen`` (after any truncation); the rest is the response."""
    rejected_prompt_len: int = 0
    """Leading prompt tokens of ``rejected``."""


def load_pairs(
    path: str | Path | SourceConfig, tokenizer: Any, *, max_seq_len: int | None = None
) -> list[PreferencePair]:
    """Read and tokenise preference JSONL or a `SourceConfig` (data/sources.py: Parquet, save_to_disk, HF
    names, column mapping); malformed rows raise `ValueError` naming the line (a source: its name, row
    number and field)."""
    rows, path, sep = read_rows(path, "preference file", PAIR_ROW_FIELDS)
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    suffix = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pairs, truncated = [], 0
    for number, row in rows:
        if not all(isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")):
            raise ValueError(f"{path}{sep}{number}: 'prompt', 'chosen' and 'rejected' must be strings")
        prompt = prefix + tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        sides, prompt_lens = [], []
        for key in ("chosen", "rejected"):
            ids = prompt + tokenizer(row[key], add_special_tokens=False)["input_ids"] + suffix
            dropped = 0
            if max_seq_len is not None and len(ids) > max_seq_len:
                truncated += 1
                dropped = len(ids) - max_seq_len
                ids = ids[-max_seq_len:]
            sides.append(ids)
            prompt_lens.append(max(len(prompt) - dropped, 0))
        pairs.append(PreferencePair(sides[0], sides[1], prompt_lens[0], prompt_lens[1]))
    if truncated:
        warnings.warn(
            f"{truncated} sequence(s) of {path.name} truncated to their last {max_seq_len} tokens", stacklevel=2
        )
    return pairs


def pack_pairs(
    pairs: Sequence[PreferencePair], indices: Sequence[int], *, weight: float = 1.0, responses_only: bool = False
) -> PackedBatch:
    """Pack pairs ``indices`` as [chosen_0, rejected_0, chosen_1, ...] with pair extras.

    ``responses_only``: the loss mask marks only response tokens as targets (DPO sums their
    log-probs); otherwise every token after the first is a target (a reward model reads one score).
    """
    sequences = [ids for i in indices for ids in (pairs[i].chosen, pairs[i].rejected)]
    masks = None
    if responses_only:
        masks = []
        for i in indices:
            for ids, prompt_len in (
                (pairs[i].chosen, pairs[i].chosen_prompt_len),
                (pairs[i].rejected, pairs[i].rejected_prompt_len),
            ):
                masks.append([0.0] * prompt_len + [1.0] * (len(ids) - prompt_len))
    batch = pack_sequences(sequences, masks)
    n = len(sequences)
    batch.extras = {
        SEQUENCE_GROUP: torch.arange(n, dtype=torch.long) // 2,
        IS_CHOSEN: (torch.arange(n) % 2 == 0).float(),
        PAIR_WEIGHT: torch.full((n,), float(weight)),
    }
    return batch


def load_pair_data(
    config: Any, tokenizer: Any, global_batch_size: int
) -> tuple[SourceSet[PreferencePair], list[PreferencePair] | None, str | None]:
    """The training pairs of a preference trainer config (``train_file``, ``data.train`` or ``data.mix``,
    each source through `load_pairs`) with their batch sampler, and the held-out pairs with their label."""

    def load(source: str | SourceConfig) -> list[PreferencePair]:
        return load_pairs(source, tokenizer, max_seq_len=config.max_seq_len)

    train = SourceSet(train_sources(config), load, global_batch_size, seed=config.seed, mix=bool(config.data.mix))
    held = eval_source(config)
    return train, (load(loader_arg(held)) if held is not None else None), (held.label if held is not None else None)
