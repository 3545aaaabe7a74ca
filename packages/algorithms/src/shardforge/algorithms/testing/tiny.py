"""The demo's building blocks, made locally (no model hub): a character-level tokenizer built with `tokenizers`
and a small Qwen3 initialised from a config (both from `shardforge.rollout.testing.tiny`, so the rollout package's
own tests use them too), and an addition dataset. Tests, benchmarks and the demos build on them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from shardforge.rollout.testing.tiny import CHARS, SPECIALS, build_char_tokenizer, build_tiny_qwen3

__all__ = ["CHARS", "SPECIALS", "build_char_tokenizer", "build_tiny_qwen3", "make_addition_data"]


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
