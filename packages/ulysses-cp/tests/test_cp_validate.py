"""Head-count validation for Ulysses CP: pure arithmetic, no process group involved."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from shardforge.ulysses_cp import valid_cp_sizes, validate_cp


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    # Validation runs before any collective: it must work (and fail) without a process group.
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "valid"),
    [
        (4, 2, 1, [1, 2, 4]),  # cp 4 > 2 kv heads: each rank gets a copy of one kv head
        (4, 4, 1, [1, 2, 4]),
        (4, 1, 1, [1, 2, 4]),  # MQA: the single kv head is repeated
        (12, 4, 1, [1, 2, 4, 12]),  # 3 and 6 divide the query heads but not the 4 kv heads (nor 3|4, 6|4)
        (6, 6, 1, [1, 2, 3, 6]),
        (32, 8, 1, [1, 2, 4, 8, 16, 32]),
        (4, 2, 2, [1, 2]),  # per TP rank: 2 query / 1 kv head
        (8, 4, 2, [1, 2, 4]),
        (12, 4, 2, [1, 2, 6]),  # per TP rank 6 / 2: 3 is out (3 ∤ 2, 2 ∤ 3)
    ],
)
def test_valid_cp_sizes_agree_with_validate_cp(heads: int, kv_heads: int, tp: int, valid: list[int]) -> None:
    assert valid_cp_sizes(heads, kv_heads, tp=tp) == valid
    for cp in range(1, heads + 2):
        if cp in valid:
            validate_cp(heads, kv_heads, cp, tp=tp)
        else:
            with pytest.raises(ValueError, match=re.escape(f"valid cp: {valid}")):
                validate_cp(heads, kv_heads, cp, tp=tp)


def test_invalid_cp_message_lists_valid_sizes() -> None:
    with pytest.raises(ValueError) as info:
        validate_cp(4, 2, 3)
    assert str(info.value) == (
        "cp=3 does not fit 4 query / 2 key-value heads: query heads must be divisible by cp and kv heads "
        "divisible by cp (or cp by kv heads); valid cp: [1, 2, 4]"
    )


def test_tp_uses_per_rank_head_counts() -> None:
    validate_cp(4, 2, 2, tp=2)  # 2 query / 1 kv head per TP rank, kv head repeated
    with pytest.raises(ValueError, match=re.escape("2 query / 1 key-value heads per TP rank (tp=2)")) as info:
        validate_cp(4, 2, 4, tp=2)
    assert "valid cp: [1, 2]" in str(info.value)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 3), (6, 3, 2)])
def test_tp_must_divide_head_counts(heads: int, kv_heads: int, tp: int) -> None:
    with pytest.raises(ValueError, match=rf"tp={tp} must divide num_attention_heads={heads}"):
        validate_cp(heads, kv_heads, 1, tp=tp)


@pytest.mark.parametrize("cp", [0, -1])
def test_cp_must_be_positive(cp: int) -> None:
    with pytest.raises(ValueError, match=rf"cp={cp} must be >= 1"):
        validate_cp(4, 2, cp)


def test_limit_caps_the_search() -> None:
    assert valid_cp_sizes(64, 64, limit=8) == [1, 2, 4, 8]
