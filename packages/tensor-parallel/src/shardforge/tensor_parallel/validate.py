"""Check that a model's shapes divide the tensor-parallel size, before any collective."""

from __future__ import annotations

from typing import Any

__all__ = ["valid_tp_sizes", "validate_tp"]


def _dims(config: Any) -> dict[str, int]:
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    dims = {
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", heads) or heads),
        "vocab_size": int(getattr(config, "vocab_size", 0) or 0),
    }
    intermediate = getattr(config, "intermediate_size", None)
    if intermediate and getattr(config, "model_type", "") != "qwen3_moe":
        dims["intermediate_size"] = int(intermediate)
    return {k: v for k, v in dims.items() if v > 0}


def valid_tp_sizes(config: Any) -> list[int]:
    """Every tp that divides all the sharded dimensions of ``config``."""
    dims = _dims(config)
    limit = min(dims.values()) if dims else 1
    return [tp for tp in range(1, limit + 1) if all(v % tp == 0 for v in dims.values())]


def validate_tp(config: Any, tp: int) -> None:
    """Raise `ValueError` naming the first dimension ``tp`` does not divide and the valid tp values."""
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    for name, value in _dims(config).items():
        if value % tp != 0:
            raise ValueError(
                f"tp={tp} must divide {name}={value} (it is split across tensor-parallel ranks); "
                f"valid tp for this model: {valid_tp_sizes(config)}"
            )
