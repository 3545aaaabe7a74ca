"""Load HF configs and models for the engine, and validate layouts against them."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from shardforge.mesh import ParallelDims

__all__ = ["is_model_dir", "load_hf_config", "validate_layout"]


def is_model_dir(source: object) -> bool:
    return isinstance(source, (str, os.PathLike))


def load_hf_config(source: Any) -> Any:
    """An HF config from a model directory, or ``source`` itself if it is already a config."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        # A copy: the engine sets attention/use_cache on its config; the caller's stays as it was.
        return copy.deepcopy(source)
    if not is_model_dir(source):
        raise TypeError(f"model must be an HF model directory or a PretrainedConfig, got {type(source).__name__}")
    path = Path(source)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {str(path)!r} does not exist; pass a directory written by "
            "`save_pretrained` (config.json + *.safetensors)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} has no config.json (found: {sorted(p.name for p in path.iterdir())[:10]}); "
            "pass a directory written by `save_pretrained`"
        )
    return AutoConfig.from_pretrained(path)


def validate_layout(dims: ParallelDims, hf_config: Any) -> None:
    """Check ``dims`` against the model's shape before any collective; raise `ValueError`."""
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    if dims.tp > 1:
        from shardforge.tensor_parallel import validate_tp

        validate_tp(hf_config, dims.tp)
    if dims.cp > 1:
        from shardforge.ulysses_cp import validate_cp

        kv_heads = int(getattr(hf_config, "num_key_value_heads", heads) or heads)
        validate_cp(heads, kv_heads, dims.cp, tp=dims.tp)
    if dims.pp > 1 and layers < dims.pp:
        raise ValueError(
            f"pp={dims.pp} needs at least one decoder layer per stage but the model has {layers} layers; "
            f"valid pp: 1..{layers}"
        )
    from shardforge.algorithms.moe_support import validate_moe_layout

    validate_moe_layout(dims, hf_config)


def materialize_reference(
    source: Any, hf_config: Any, *, dtype: torch.dtype, attn_implementation: str, seed: int
) -> Any:
    """The full model on CPU (rank 0 only): from disk, or initialised from the config with ``seed``."""
    from transformers import AutoModelForCausalLM

    if is_model_dir(source):
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
