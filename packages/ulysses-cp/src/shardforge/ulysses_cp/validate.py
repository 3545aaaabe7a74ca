"""Head-count checks for Ulysses context parallelism, before any collective."""

from __future__ import annotations

__all__ = ["valid_cp_sizes", "validate_cp"]


def _ok(heads: int, kv_heads: int, cp: int) -> bool:
    return heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0)


def valid_cp_sizes(num_heads: int, num_kv_heads: int, *, tp: int = 1, limit: int = 64) -> list[int]:
    """cp values that work for these head counts (per TP rank when tp > 1)."""
    heads, kv = num_heads // tp, max(num_kv_heads // tp, 1)
    return [cp for cp in range(1, min(limit, heads) + 1) if _ok(heads, kv, cp)]


def validate_cp(num_heads: int, num_kv_heads: int, cp: int, *, tp: int = 1) -> None:
    """Raise `ValueError` unless heads (per TP rank) split over ``cp`` ranks.

    Query heads must be divisible by cp; key/value heads must be divisible by cp, or cp by
    them (then each rank gets a copy of one kv head).
    """
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    if num_heads % tp or num_kv_heads % tp:
        raise ValueError(f"tp={tp} must divide num_attention_heads={num_heads} and num_key_value_heads={num_kv_heads}")
    heads, kv = num_heads // tp, num_kv_heads // tp
    if not _ok(heads, kv, cp):
        per = f" per TP rank (tp={tp})" if tp > 1 else ""
        raise ValueError(
            f"cp={cp} does not fit {heads} query / {kv} key-value heads{per}: query heads must be divisible by cp "
            f"and kv heads divisible by cp (or cp by kv heads); valid cp: {valid_cp_sizes(num_heads, num_kv_heads, tp=tp)}"
        )
