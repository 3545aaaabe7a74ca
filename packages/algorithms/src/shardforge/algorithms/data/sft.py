"""SFT data: JSONL rows -> token ids + loss masks, packed into batches.

Accepted rows (one JSON object per line):

    {"prompt": "...", "completion": "..."}          loss on the completion (+ EOS)
    {"messages": [{"role": ..., "content": ...}]}   loss on assistant turns (chat template)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardforge.algorithms.batching import PackedBatch, pack_sequences
from shardforge.algorithms.data.jsonl import read_jsonl
from shardforge.algorithms.data.sources import SourceConfig, read_source

__all__ = ["SFT_ROW_FIELDS", "SFTExample", "load_sft_examples", "pack_examples", "tokenize_sft_row"]


SFT_ROW_FIELDS = (("prompt", "completion"), ("messages",))
"""The row shapes SFT accepts (see `shardforge.algorithms.data.jsonl.RowFields`)."""


@dataclass(frozen=True, slots=True)
class SFTExample:
    """One tokenised example: ids and a per-token target mask."""

    input_ids: list[int]
    loss_mask: list[float]


def load_sft_examples(
    path: str | Path | SourceConfig, tokenizer: Any, *, max_seq_len: int | None = None
) -> list[SFTExample]:
    """Read and tokenise a JSONL file or a `SourceConfig` (data/sources.py); a malformed row is a `ValueError`
    naming the file and 1-based line (a source: its name, row number and field)."""
    if isinstance(path, SourceConfig):
        rows = read_source(path, SFT_ROW_FIELDS)
        path, sep = Path(path.label), " row "
    else:
        path, sep = Path(path), ":"
        rows = read_jsonl(path, "dataset file", SFT_ROW_FIELDS)
    examples = []
    truncated = emptied = 0
    for number, row in rows:
        example = tokenize_sft_row(row, tokenizer, where=f"{path}{sep}{number}")
        if max_seq_len is not None and len(example.input_ids) > max_seq_len:
            truncated += 1
            example = SFTExample(example.input_ids[:max_seq_len], example.loss_mask[:max_seq_len])
            if not any(example.loss_mask):  # the cut removed every target token: nothing to learn
                emptied += 1
                continue
        examples.append(example)
    if not examples:
        raise ValueError(
            f"all {len(rows)} rows of {path} lose every target token when truncated to max_seq_len={max_seq_len}; "
            "raise max_seq_len or shorten the prompts"
        )
    if truncated:
        warnings.warn(
            f"{truncated} of {len(rows)} examples in {path.name} truncated to max_seq_len={max_seq_len} tokens"
            + (f"; {emptied} of them lost every target token and are skipped" if emptied else ""),
            stacklevel=2,
        )
    return examples


def tokenize_sft_row(row: dict[str, Any], tokenizer: Any, *, where: str = "row") -> SFTExample:
    """Tokenise one prompt/completion or chat row; a `ValueError` names a malformed row."""
    present = {k for k, v in row.items() if v is not None}
    if {"prompt", "completion"} <= present:
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f"{where}: 'prompt' and 'completion' must be strings")
        prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        prompt_ids = prefix + tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            completion_ids = [*completion_ids, tokenizer.eos_token_id]
        if not completion_ids:
            raise ValueError(f"{where}: the completion is empty, so there is nothing to train on")
        ids = prompt_ids + completion_ids
        mask = [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
        return SFTExample(ids, mask)
    if "messages" in present:
        return _tokenize_chat(row["messages"], tokenizer, where)
    raise ValueError(
        f"{where} has fields {sorted(present)}; expected 'prompt' + 'completion' (strings) or 'messages' "
        "(a list of {'role', 'content'})"
    )


def _tokenize_chat(messages: Any, tokenizer: Any, where: str) -> SFTExample:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise ValueError(f"{where}: message {i} must have 'role' and 'content', got {message!r}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{where}: chat rows need a tokenizer with a chat_template; use prompt/completion rows")
    ids: list[int] = []
    mask: list[float] = []
    for i, message in enumerate(messages):
        # Tokenise growing prefixes; the new tokens of an assistant turn are targets.
        if message["role"] == "assistant":
            before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True)
            after = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True)
            before, after = _ids(before), _ids(after)
            if after[: len(before)] != before or before[: len(ids)] != ids:
                raise ValueError(f"{where}: the chat template is not prefix-stable; cannot locate assistant tokens")
            ids.extend(before[len(ids) :])
            mask.extend([0.0] * (len(before) - len(mask)))
            ids.extend(after[len(before) :])
            mask.extend([1.0] * (len(after) - len(before)))
    if not any(mask):
        raise ValueError(f"{where}: no assistant message, so there is nothing to train on")
    return SFTExample(ids, mask)


def _ids(value: Any) -> list[int]:
    if isinstance(value, dict) or hasattr(value, "keys"):
        value = value["input_ids"]
    return list(value)


def pack_examples(examples: list[SFTExample], indices: list[int]) -> PackedBatch:
    """Pack the examples at ``indices`` into one `PackedBatch`."""
    chosen = [examples[i] for i in indices]
    return pack_sequences([e.input_ids for e in chosen], [e.loss_mask for e in chosen])
