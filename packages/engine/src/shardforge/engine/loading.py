"""Load HF configs and full reference models for the engine."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["check_model_dir", "is_model_dir", "is_vlm", "load_hf_config", "materialize_reference"]


def is_vlm(hf_config: Any) -> bool:
    """Whether ``hf_config`` is a vision-language model (has a vision tower config)."""
    return getattr(hf_config, "vision_config", None) is not None


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
    return AutoConfig.from_pretrained(check_model_dir(source))


def check_model_dir(source: str | os.PathLike[str]) -> Path:
    """``source`` as a `Path` if it is a directory with a config.json; else a `FileNotFoundError` saying what to pass.

    Cheap (no transformers import): the launching process checks every model directory with it.
    """
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
    return path


def materialize_reference(
    source: Any, hf_config: Any, *, dtype: torch.dtype, attn_implementation: str, seed: int
) -> Any:
    """The full model on CPU (rank 0 only): from disk, or initialised from the config with ``seed``."""
    from transformers import AutoModelForCausalLM

    if is_model_dir(source):
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
