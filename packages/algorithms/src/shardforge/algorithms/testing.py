"""Tiny, locally built models, tokenizers and data for tests, benchmarks and examples.

One place for what every trainer test needs (no model hub): the demo's character tokenizer
(built with `tokenizers`, saved with ``save_pretrained``), a tiny Qwen3 initialised from a
config with a fixed seed and saved with ``save_pretrained`` (so the real loading code runs),
and the demo's addition data as JSONL. Use it from a pytest fixture:

    @pytest.fixture(scope="module")
    def assets(tmp_path_factory):
        return tiny_assets(tmp_path_factory.mktemp("grpo"), seed=11)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["tiny_assets"]


def tiny_assets(
    root: str | Path,
    *,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    data: bool = True,
    max_operand: int = 20,
    num_eval: int = 16,
    data_seed: int = 2,
    tokenizer_dir: str = "tokenizer",
) -> dict[str, Any]:
    """Build a tokenizer, a tiny Qwen3 and (``data=True``) addition train/eval JSONL under ``root``.

    Returns ``{"root": Path, "tokenizer": tokenizer, "model": str (model dir), "train": Path,
    "eval": Path}`` (no train/eval without data). ``seed`` initialises the weights, ``data_seed``
    shuffles the data; ``tokenizer_dir="model"`` saves the tokenizer inside the model directory.
    """
    from shardforge.algorithms.demos.demo import build_char_tokenizer, build_tiny_qwen3, make_addition_data

    root = Path(root)
    tokenizer = build_char_tokenizer(root / tokenizer_dir)
    build_tiny_qwen3(root / "model", tokenizer, hidden=hidden, layers=layers, seed=seed)
    assets: dict[str, Any] = {"root": root, "tokenizer": tokenizer, "model": str(root / "model")}
    if data:
        train, evaluation = make_addition_data(
            root / "data", max_operand=max_operand, num_eval=num_eval, seed=data_seed
        )
        assets |= {"train": train, "eval": evaluation}
    return assets
