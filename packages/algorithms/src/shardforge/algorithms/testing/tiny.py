"""The demo's building blocks, made locally (no model hub): a character-level tokenizer built with `tokenizers`,
a small Qwen3 initialised from a config, and an addition dataset. Tests, benchmarks and the demos build on them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ["CHARS", "SPECIALS", "build_char_tokenizer", "build_tiny_qwen3", "make_addition_data"]

CHARS = list("0123456789+-*=? ")
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_char_tokenizer(out_dir: str | Path) -> Any:
    """A character-level HF fast tokenizer, saved with `save_pretrained`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
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


def build_tiny_qwen3(out_dir: str | Path, tokenizer: Any, *, hidden: int = 256, layers: int = 4, seed: int = 0) -> int:
    """Save a randomly initialised small Qwen3 with `save_pretrained`; return its parameter count."""
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
        max_position_embeddings=64,
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


def make_addition_data(
    out_dir: str | Path, *, max_operand: int = 99, num_eval: int = 200, seed: int = 0
) -> tuple[Path, Path]:
    """Write train.jsonl / eval.jsonl of ``a+b=`` -> ``c``; eval pairs never appear in train."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(pairs)
    held_out, train = pairs[:num_eval], pairs[num_eval:]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train", train), ("eval", held_out)):
        path = out / f"{name}.jsonl"
        with path.open("w") as handle:
            for a, b in rows:
                handle.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")
        paths.append(path)
    return paths[0], paths[1]
