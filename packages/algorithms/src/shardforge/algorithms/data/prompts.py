"""Prompt files for the RL trainers: rows -> tokenised prompts with their reference answers (`PromptSet`).

Rows are the SFT prompt/completion JSONL: ``{"prompt": "12+7=", "completion": "19"}``; the
completion is the reference answer the reward function checks. A vision-language model reads chat rows
with image parts instead (`load_image_prompts`; the rows of VLM SFT, the last assistant message being
the reference).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from shardforge.algorithms.data.sources import SourceConfig, read_rows
from shardforge.rollout.types import ImageInputs, PromptSet

__all__ = ["IMAGE_PROMPT_ROW_FIELDS", "PROMPT_ROW_FIELDS", "PromptSet", "load_image_prompts", "load_prompts"]

PROMPT_ROW_FIELDS = (("prompt", "completion"),)
"""The row shape of a prompt file: the prompt and its reference answer."""
IMAGE_PROMPT_ROW_FIELDS = (("messages",),)
"""The row shape of a vision-language model's prompt file: an HF chat with image parts (`load_image_prompts`)."""
RL_PROMPT_ROW_FIELDS = PROMPT_ROW_FIELDS + IMAGE_PROMPT_ROW_FIELDS
"""What the launcher accepts for GRPO / PPO before any rank starts: either shape (the ranks read the model's
config and require the one that fits it: image chats for a vision-language model)."""


def load_prompts(path: str | Path | SourceConfig, tokenizer: Any, *, max_prompt_len: int | None = None) -> PromptSet:
    """Read prompt/completion JSONL or a `SourceConfig` (data/sources.py; map e.g. ``{prompt: question,
    completion: answer}``); prompts longer than ``max_prompt_len`` tokens are skipped (with a warning
    naming how many)."""
    rows, path, sep = read_rows(path, "prompt file", PROMPT_ROW_FIELDS)
    texts, refs, ids = [], [], []
    skipped = 0
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    for number, row in rows:
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
            raise ValueError(f"{path}{sep}{number}: 'prompt' and 'completion' (the reference) must be strings")
    # One batched tokenizer call: per-prompt calls were most of a rank's prompt loading (9,800 demo prompts).
    encoded = tokenizer([row["prompt"] for _, row in rows], add_special_tokens=False)["input_ids"] if rows else []
    for (_, row), row_ids in zip(rows, encoded):
        tokens = prefix + list(row_ids)
        if max_prompt_len is not None and len(tokens) > max_prompt_len:
            skipped += 1
            continue
        texts.append(row["prompt"])
        refs.append(row["completion"])
        ids.append(tokens)
    if skipped:
        warnings.warn(f"skipped {skipped} prompt(s) of {path.name} longer than {max_prompt_len} tokens", stacklevel=2)
    if not texts:
        raise ValueError(
            f"every prompt of {path} is longer than max_prompt_len={max_prompt_len} tokens; raise max_prompt_len"
        )
    return PromptSet(texts, refs, ids)


def load_image_prompts(
    path: str | Path | SourceConfig,
    tokenizer: Any,
    image_processor: Any,
    *,
    image_token: str,
    max_prompt_len: int | None = None,
) -> PromptSet:
    """Read chat rows with image parts (the rows of VLM SFT, `data.vlm`) as prompts: every message before
    the last assistant one is the prompt (rendered with the generation prompt, image tokens expanded, the
    images through the image processor; relative image paths resolve against the data file's directory),
    that assistant message's content is the reference (or the row's ``completion`` when the messages end
    on the user's turn). Prompts longer than ``max_prompt_len`` tokens are skipped (with a warning)."""
    from shardforge.algorithms.data.vlm import encode_vlm_prompt

    rows, label, sep = read_rows(path, "prompt file", IMAGE_PROMPT_ROW_FIELDS)
    where_file = Path(path.source) if isinstance(path, SourceConfig) else Path(path)
    base = where_file.parent if where_file.is_file() else None
    texts, refs, ids, images = [], [], [], []
    skipped = 0
    for number, row in rows:
        where = f"{label}{sep}{number}"
        messages, reference = _prompt_and_reference(row, where)
        prompt = encode_vlm_prompt(
            messages, tokenizer, image_processor, image_token=image_token, where=where, base=base
        )
        if max_prompt_len is not None and len(prompt.input_ids) > max_prompt_len:
            skipped += 1
            continue
        texts.append(_text_of(messages))
        refs.append(reference)
        ids.append(prompt.input_ids)
        has_images = prompt.image_grid_thw.shape[0] > 0
        images.append(ImageInputs(prompt.pixel_values, prompt.image_grid_thw) if has_images else None)
    if skipped:
        warnings.warn(f"skipped {skipped} prompt(s) of {label.name} longer than {max_prompt_len} tokens", stacklevel=2)
    if not texts:
        raise ValueError(
            f"every prompt of {label} is longer than max_prompt_len={max_prompt_len} tokens; raise max_prompt_len"
        )
    return PromptSet(texts, refs, ids, images)


def _prompt_and_reference(row: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], str]:
    messages = row["messages"]
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    if messages[-1].get("role") == "assistant":
        messages, reference = messages[:-1], messages[-1].get("content")
    else:
        reference = row.get("completion")
    if not isinstance(reference, str) or not messages:
        raise ValueError(
            f"{where}: an image prompt row needs its reference answer as a last assistant message with string "
            "content (or a string 'completion' field) after at least one prompt message"
        )
    return messages, reference


def _text_of(messages: list[dict[str, Any]]) -> str:
    """The text parts of ``messages`` (what reward functions and logs see as the prompt)."""
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(parts)
