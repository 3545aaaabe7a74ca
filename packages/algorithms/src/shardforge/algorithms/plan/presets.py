"""Model configs the planner knows by name (published ``config.json`` values; no network needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "load_model_config"]

_LLAMA3 = {
    "model_type": "llama",
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
_QWEN3 = {
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "head_dim": 128,
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "qwen3-8b": {
        **_QWEN3,
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "qwen3-30b-a3b": {
        **_QWEN3,
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
}
"""Preset name -> HF config fields (from the models' published config.json)."""


def load_model_config(source: Any) -> Any:
    """An HF `PretrainedConfig` from a preset name, a ``config.json`` path, a model directory,
    or a config object (returned as is)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"model must be a preset name, a config.json path or a model directory, got {source!r}")
    text = str(source)
    if text in PRESETS:
        fields = dict(PRESETS[text])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ValueError(f"{str(path)!r} has no model_type; is it an HF config.json?")
        return AutoConfig.for_model(data.pop("model_type"), **data)
    raise ValueError(
        f"unknown model {text!r}: not a preset, a config.json or a model directory; presets: {sorted(PRESETS)}"
    )
