"""Tiny, locally built vision-language assets for tests: a Qwen2.5-VL with its tokenizer and image
processor, and coloured-square images with chat rows that ask for the colour. No model hub.

    assets = tiny_vlm_assets(tmp_path, seed=0)
    assets["model"]    # directory: config.json, model.safetensors, tokenizer + chat template,
                       # preprocessor_config.json (Qwen2-VL image processor)
    assets["train"]    # JSONL chat rows with {"type": "image", "image": "images/<name>.png"} content parts
                       # (paths relative to the JSONL file's directory)

The model loads with ``AutoModelForImageTextToText.from_pretrained``; the tokenizer with
``AutoTokenizer`` and the image processor with ``AutoImageProcessor`` from the same directory.
``AutoProcessor`` also needs torchvision in transformers 5 (its video processor); see
docs/packages/algorithms-vlm.md.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ["VLM_CHAT_TEMPLATE", "VLM_SPECIALS", "build_vlm_tokenizer", "make_color_rows", "tiny_vlm_assets"]

VLM_SPECIALS = [
    "<pad>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
]
# Qwen2.5-VL's layout of image parts (vision_start, one image_pad that the processor expands, vision_end);
# string or list-of-parts content. Prefix-stable, so assistant tokens are found by rendering prefixes.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 220), "yellow": (230, 220, 20)}


def build_vlm_tokenizer() -> Any:
    """A printable-ASCII character tokenizer with Qwen2.5-VL's special tokens and `VLM_CHAT_TEMPLATE`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(VLM_SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m).|\n"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VLM_SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def tiny_qwen2_5_vl_config(
    tokenizer: Any, *, hidden: int = 32, layers: int = 2, vision_depth: int = 2, initializer_range: float = 0.02
) -> Any:
    """A Qwen2.5-VL config: ``layers`` text layers of width ``hidden``, a ``vision_depth``-block vision
    tower (patch 14, 2x2 merge: a 56x56 image is 16 patches and 4 image tokens). A larger
    ``initializer_range`` (e.g. 0.2) makes an untrained model's outputs depend visibly on positions and
    images (parity tests); the default 0.02 gives near-uniform outputs that train quickly."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VLM_SPECIALS}
    if hidden % 32:
        raise ValueError(f"hidden={hidden} must be a multiple of 32 (4 heads, 1:1:2 mRoPE split of head_dim / 2)")
    q = hidden // 4 // 2 // 4
    text = {
        "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": hidden * 2,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
        # head_dim / 2 rotary frequencies (hidden 32: 4), split 1:1:2 over (temporal, height, width)
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [q, q, 2 * q]},
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<pad>"],
        "initializer_range": initializer_range,
    }  # fmt: skip
    vision = {
        "depth": vision_depth, "hidden_size": hidden, "intermediate_size": hidden * 2, "num_heads": 2,
        "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 56, "fullatt_block_indexes": [vision_depth - 1], "initializer_range": initializer_range,
    }  # fmt: skip
    # Generic PretrainedConfig attributes the typed signature does not list (generation and weight init read them).
    common: dict[str, Any] = {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<pad>"],
        "initializer_range": initializer_range,
    }  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, **common,
    )  # fmt: skip


def make_color_rows(
    image_dir: Path, count: int, *, seed: int, sizes: tuple[tuple[int, int], ...], relative_to: Path | None = None
) -> list[dict]:
    """``count`` chat rows: one or two solid-colour PNGs of the given (width, height) sizes, the user asks
    for the colour(s), the assistant answers. Images are written to ``image_dir``; rows name them relative
    to ``relative_to`` (the data file's directory) when given, else by absolute path."""
    from PIL import Image

    image_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        parts: list[dict[str, str]] = []
        names = []
        for j in range(1 + (i % 3 == 2)):  # every third row has two images
            name = rng.choice(sorted(COLORS))
            width, height = rng.choice(sizes)
            path = image_dir / f"img{i}_{j}.png"
            Image.new("RGB", (width, height), COLORS[name]).save(path)
            parts.append({"type": "image", "image": str(path.relative_to(relative_to) if relative_to else path)})
            names.append(name)
        parts.append({"type": "text", "text": "colour?" if len(names) == 1 else "colours?"})
        rows.append(
            {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": " ".join(names)}]}
        )
    return rows


def tiny_vlm_assets(
    root: str | Path,
    *,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    vision_depth: int = 2,
    num_train: int = 12,
    num_eval: int = 4,
    data_seed: int = 1,
    initializer_range: float = 0.02,
    sizes: tuple[tuple[int, int], ...] = ((56, 56), (84, 56), (56, 84)),
) -> dict[str, Any]:
    """Build a tiny Qwen2.5-VL (weights from ``seed``), its tokenizer + image processor, and colour
    chat rows (train / eval JSONL) under ``root``.

    Returns ``{"root": Path, "model": str (model dir), "tokenizer", "image_processor", "train": Path,
    "eval": Path}``.
    """
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    root = Path(root)
    model_dir = root / "model"
    tokenizer = build_vlm_tokenizer()
    # 28x28 (one merged token) .. 28*28*16 pixels (16 image tokens) per image keeps sequences short.
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    config = tiny_qwen2_5_vl_config(
        tokenizer, hidden=hidden, layers=layers, vision_depth=vision_depth, initializer_range=initializer_range
    )
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    image_processor.save_pretrained(str(model_dir))
    data_dir = root / "data"
    rows = make_color_rows(data_dir / "images", num_train + num_eval, seed=data_seed, sizes=sizes, relative_to=data_dir)
    files = {}
    for split, chunk in (("train", rows[:num_train]), ("eval", rows[num_train:])):
        files[split] = data_dir / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in chunk))
    return {"root": root, "model": str(model_dir), "tokenizer": tokenizer, "image_processor": image_processor} | files
