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

__all__ = ["CHAT_TEMPLATE", "tiny_assets", "tiny_chat_assets"]


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


CHAT_SPECIALS = ["<pad>", "<bos>", "<|im_end|>", "<unk>", "<|im_start|>"]
CHAT_MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# Qwen3-like, and deliberately not prefix-stable: an assistant turn is generated after
# "<|im_start|>assistant\n" but rendered in the history with an empty think block in front, so
# re-tokenising a rendered conversation gives other ids than the ones the engine produced.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='function.name') | join(',') }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}"
    "<|im_start|>assistant\n<think></think>{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_chat_assets(root: str | Path, *, seed: int = 0, hidden: int = 32, layers: int = 2) -> dict[str, Any]:
    """A printable-ASCII character tokenizer with Qwen3-style chat markers (``<|im_start|>``,
    ``<|im_end|>`` = EOS, ``<tool_call>``, ...) and a chat template that is not prefix-stable
    (`CHAT_TEMPLATE`), plus a tiny Qwen3 over that vocabulary; for multi-turn / tool-use tests.

    Returns ``{"root": Path, "tokenizer": tokenizer, "model": str (model dir)}``.
    """
    import torch
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    root = Path(root)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(CHAT_SPECIALS + CHAT_MARKERS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m).|\n"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIALS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_MARKERS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(root / "model"))
    tokenizer.save_pretrained(str(root / "model"))
    return {"root": root, "tokenizer": tokenizer, "model": str(root / "model")}
