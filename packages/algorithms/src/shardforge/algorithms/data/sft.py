"""SFT data: JSONL rows -> token ids + loss masks, packed into batches.

Accepted rows (one JSON object per line):

    {"prompt": "...", "completion": "..."}          loss on the completion (+ EOS)
    {"messages": [{"role": ..., "content": ...}]}   loss on assistant turns (chat template)
    {"messages": [...], "tools": [{schema}, ...]}   the same with tool calls (HF format): assistant
        messages may carry ``tool_calls``, ``tool`` messages hold results; ``tools`` goes to the
        template as ``tools=``; the tool-call text is a target, tool results are not
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardforge.algorithms.data.sources import SourceConfig, read_rows
from shardforge.engine.batching import PackedBatch, pack_sequences

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
    rows, path, sep = read_rows(path, "dataset file", SFT_ROW_FIELDS)
    examples = []
    truncated = emptied = 0
    pretokenised = _tokenize_completions(rows, tokenizer)
    # Read once: each read of a transformers tokenizer's bos/eos_token_id converts the token string again
    # (~20 us; four per row were a fifth of the demo's 9,800-row tokenisation).
    special = (tokenizer.bos_token_id, tokenizer.eos_token_id)
    for number, row in rows:
        where = f"{path}{sep}{number}"
        example = tokenize_sft_row(row, tokenizer, where=where, pieces=pretokenised.get(number), special_ids=special)
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


def _tokenize_completions(rows: list[tuple[int, dict[str, Any]]], tokenizer: Any) -> dict[int, tuple[Any, Any]]:
    """Prompt and completion ids of every well-formed prompt/completion row, in one batched tokenizer call.

    One call for the whole file instead of two per row: a fast tokenizer's per-call Python overhead was
    most of the start-up's tokenisation time (9,800 demo rows: 19,600 calls). Malformed rows are left
    out here and get their error from `tokenize_sft_row`.
    """
    numbers, texts = [], []
    for number, row in rows:
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            numbers.append(number)
            texts += [prompt, completion]
    if not texts:
        return {}
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return {number: (ids[2 * i], ids[2 * i + 1]) for i, number in enumerate(numbers)}


def tokenize_sft_row(
    row: dict[str, Any],
    tokenizer: Any,
    *,
    where: str = "row",
    pieces: tuple[Any, Any] | None = None,
    special_ids: tuple[int | None, int | None] | None = None,
) -> SFTExample:
    """Tokenise one prompt/completion or chat row; a `ValueError` names a malformed row.

    ``pieces``: the row's prompt and completion ids if already tokenised (a batched call).
    ``special_ids``: the tokenizer's ``(bos_token_id, eos_token_id)`` if already read (a loop over rows).
    """
    present = {k for k, v in row.items() if v is not None}
    if {"prompt", "completion"} <= present:
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f"{where}: 'prompt' and 'completion' must be strings")
        if pieces is None:
            pieces = (tokenizer(prompt, add_special_tokens=False)["input_ids"],
                      tokenizer(completion, add_special_tokens=False)["input_ids"])  # fmt: skip
        bos, eos = special_ids or (tokenizer.bos_token_id, tokenizer.eos_token_id)
        prompt_ids = ([bos] if bos is not None else []) + list(pieces[0])
        completion_ids = list(pieces[1])
        if eos is not None:
            completion_ids = [*completion_ids, eos]
        if not completion_ids:
            raise ValueError(f"{where}: the completion is empty, so there is nothing to train on")
        ids = prompt_ids + completion_ids
        mask = [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
        return SFTExample(ids, mask)
    if "messages" in present:
        return _tokenize_chat(row["messages"], tokenizer, where, row.get("tools"))
    raise ValueError(
        f"{where} has fields {sorted(present)}; expected 'prompt' + 'completion' (strings) or 'messages' "
        "(a list of {'role', 'content'})"
    )


def _tokenize_chat(messages: Any, tokenizer: Any, where: str, tools: Any = None) -> SFTExample:
    _check_messages(messages, where)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: 'tools' must be a list of JSON schema objects ({{'type': 'function', ...}})")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{where}: chat rows need a tokenizer with a chat_template; use prompt/completion rows")

    def render(part: list[dict[str, Any]], generation_prompt: bool) -> str:
        try:
            text = tokenizer.apply_chat_template(
                part, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:
            raise ValueError(f"{where}: the chat template failed on this row: {type(exc).__name__}: {exc}") from exc
        return str(text)

    full = render(messages, False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            spans.append(
                _assistant_span(i, messages, full, spans[-1][1] if spans else 0, render, tokenizer.eos_token, where)
            )
    if not spans:
        raise ValueError(f"{where}: no assistant message, so there is nothing to train on")
    # Tokenise piece by piece (context, assistant turn, context, ...): the assistant tokens are exactly
    # the ids a model generates after the rendered context, as in a token-in/token-out rollout.
    ids: list[int] = []
    mask: list[float] = []
    cursor = 0
    for start, end in [*spans, (len(full), len(full))]:
        assert start >= cursor, (start, cursor)  # each span starts after the previous one (prefix-stable context)
        for text, target in ((full[cursor:start], 0.0), (full[start:end], 1.0)):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids.extend(piece)
            mask.extend([target] * len(piece))
        cursor = end
    return SFTExample(ids, mask)


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"{where}: message {i} must have 'role' and 'content', got {message!r}")
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
            raise ValueError(
                f"{where}: message {i}: 'tool_calls' must be a list on an assistant message "
                f"([{{'type': 'function', 'function': {{'name': ..., 'arguments': {{...}}}}}}]), got role "
                f"{message['role']!r} and {type(calls).__name__}"
            )
        if "content" not in message and not calls:
            raise ValueError(f"{where}: message {i} must have 'role' and 'content', got {message!r}")
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(c, dict) and c.get("type") == "image" for c in content):
            raise ValueError(
                f"{where}: message {i} has an image content part, but the model is text-only (its config.json "
                "has no vision_config); image rows need a vision-language model (e.g. Qwen2.5-VL, "
                "docs/packages/algorithms-vlm.md), or drop the image parts"
            )


# Qwen3-style templates drop the think block of an assistant turn from the history (once a later turn
# follows, or a later user query); that rewrite, and only that one, is accepted when locating the turn.
_THINK = re.compile(r"\s*<think>.*?</think>\s*", re.S)


def _assistant_span(
    i: int, messages: list[dict[str, Any]], full: str, cursor: int, render: Any, eos: str | None, where: str
) -> tuple[int, int]:
    """Character span of assistant message ``i`` in the rendered conversation ``full`` (searched from
    ``cursor``): the turn as the template renders it when it is the last message, right after the
    generation prompt, through its end-of-turn token (EOS) but not the newline after it."""
    bare, context = render(messages[:i], False), render(messages[:i], True)
    own = render(messages[: i + 1], False)
    if not own.startswith(context) or not context.startswith(bare):
        raise ValueError(
            f"{where}: the chat template does not render assistant message {i} after its generation prompt "
            "(not prefix-stable), so its tokens cannot be located"
        )
    opening, turn = context[len(bare) :], own[len(context) :]
    think = _THINK.match(turn)
    for candidate in (turn, turn[think.end() :]) if think else (turn,):
        found = full.find(opening + candidate, cursor)
        if found >= 0 and candidate:
            start = found + len(opening)
            if eos and eos in candidate and not candidate[candidate.rindex(eos) + len(eos) :].strip():
                candidate = candidate[: candidate.rindex(eos) + len(eos)]  # the newline after EOS is template
            return start, start + len(candidate)
    raise ValueError(
        f"{where}: the chat template rewrites assistant message {i} once later messages follow it (not "
        "prefix-stable beyond dropping a think block), so its tokens cannot be located"
    )


def pack_examples(examples: list[SFTExample], indices: list[int]) -> PackedBatch:
    """Pack the examples at ``indices`` into one `PackedBatch`."""
    chosen = [examples[i] for i in indices]
    return pack_sequences([e.input_ids for e in chosen], [e.loss_mask for e in chosen])
