"""Greedy-generation exact-match accuracy (single process, for small held-out sets)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["exact_match_accuracy", "greedy_answers"]


@torch.no_grad()
def greedy_answers(
    model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int = 8, batch_size: int = 128
) -> list[str]:
    """Greedy completions of ``prompts`` (text after the prompt, up to EOS)."""
    model.eval()
    answers: list[str] = []
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        encoded = [prefix + tokenizer(p, add_special_tokens=False)["input_ids"] for p in chunk]
        width = max(len(e) for e in encoded)
        # Left padding keeps every prompt's last token at the same position for generation.
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        device = next(model.parameters()).device
        generated = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
        for row in generated[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            answers.append(tokenizer.decode(row, skip_special_tokens=True).strip())
    return answers


def exact_match_accuracy(
    model: Any, tokenizer: Any, prompts: Sequence[str], references: Sequence[str], **kwargs: Any
) -> float:
    """Fraction of prompts whose greedy answer equals the reference (after strip)."""
    if len(prompts) != len(references):
        raise ValueError(f"{len(prompts)} prompts but {len(references)} references")
    if not prompts:
        raise ValueError("no prompts to evaluate")
    answers = greedy_answers(model, tokenizer, prompts, **kwargs)
    return sum(a == r.strip() for a, r in zip(answers, references)) / len(prompts)
