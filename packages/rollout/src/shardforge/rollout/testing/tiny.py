"""A tiny HF model and tokenizer made locally (no model hub), saved with ``save_pretrained`` so the real loading
code runs: a character-level fast tokenizer built with `tokenizers` and a small Qwen3 initialised from a config with
a fixed seed. For testing code that drives a rollout engine (a workflow, an agent, a reward) on a CPU in seconds::

    tokenizer = build_char_tokenizer(tmp / "model")
    build_tiny_qwen3(tmp / "model", tokenizer, hidden=32, layers=2)
    engine = HFRolloutEngine(tmp / "model", tokenizer)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CHARS", "PRINTABLE_CHARS", "SPECIALS", "build_char_tokenizer", "build_tiny_qwen3", "tiny_model"]

CHARS = list("0123456789+-*=? ")
PRINTABLE_CHARS = [chr(code) for code in range(32, 127)] + ["\n"]
"""Printable ASCII and the newline: enough for chat text rendered by a template (``User: ...\\n\\nAssistant:``)."""
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_char_tokenizer(out_dir: str | Path, *, chars: Sequence[str] = tuple(CHARS)) -> Any:
    """A character-level HF fast tokenizer over ``chars`` (after the `SPECIALS`), saved with `save_pretrained`.
    The default, `CHARS`, covers arithmetic; `PRINTABLE_CHARS` covers chat text (letters, punctuation, newline)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(chars))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # every character its own token; [\s\S], not ".": the regex's "." does not match a newline
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    # BOS first, as training feeds it (`data.sft` prepends bos_token_id): a plain `tok(prompt)` +
    # `model.generate` on an export then sees the same ids as training and our evaluation.
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tiny_qwen3(
    out_dir: str | Path, tokenizer: Any, *, hidden: int = 256, layers: int = 4, seed: int = 0, max_positions: int = 64
) -> int:
    """Save a randomly initialised small Qwen3 with `save_pretrained` (a context of ``max_positions`` tokens);
    return its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return sum(p.numel() for p in model.parameters())


def tiny_model(root: str | Path, *, seed: int = 0, hidden: int = 32, layers: int = 2) -> dict[str, Any]:
    """The character tokenizer (``root/tokenizer``) and a tiny Qwen3 over it (``root/model``, initialised with
    ``seed``); returns ``{"root", "tokenizer", "model"}`` (the model directory as a string)."""
    root = Path(root)
    tokenizer = build_char_tokenizer(root / "tokenizer")
    build_tiny_qwen3(root / "model", tokenizer, hidden=hidden, layers=layers, seed=seed)
    return {"root": root, "tokenizer": tokenizer, "model": str(root / "model")}
