"""Dtype names as configs write them (``"bf16"``, ``"bfloat16"``, ``"fp32"``) -> ``torch.dtype``."""

from __future__ import annotations

import torch

__all__ = ["parse_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16`` (and fp32, fp16)."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(_DTYPES)}")
    return _DTYPES[key]
