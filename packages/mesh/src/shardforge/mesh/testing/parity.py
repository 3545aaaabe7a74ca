"""Comparing statistics of two runs that round differently (another layout, process count,
thread count or CPU): continuous values within a tolerance, discrete counts within a stated
number of boundary items. See docs/testing.md for how the tolerances are chosen.

A discrete statistic (a clip fraction, a count of masked tokens, an exact-match accuracy) is a
step function of continuous values: an item whose value lies within rounding distance of the
threshold may change side when the summation order changes. Comparing such a statistic with a
continuous tolerance (``abs(a - b) <= 1e-5``) therefore fails on correct code whenever one item
sits near the threshold. Compare it as a count instead, allowing ``boundary`` items to change
side, *and* compare the continuous quantities under it (loss, values, ratios) with a tolerance:
a real bug (a wrong clip sign, a dropped token, a wrong normaliser) moves those as well, or
moves the count by more than a few items.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch


def whole_count(fraction: float, total: float) -> int:
    """The number of items that ``fraction`` of ``total`` stands for; raises if it is not whole
    (the caller passed the wrong denominator)."""
    count = fraction * total
    if not math.isfinite(count) or abs(count - round(count)) > 1e-6 * max(1.0, total):
        raise AssertionError(f"fraction {fraction!r} of {total!r} items is not a whole count ({count!r})")
    return round(count)


def assert_counts_match(a: float, b: float, total: float, *, boundary: int, context: tuple[Hashable, ...] = ()) -> None:
    """``a`` and ``b`` are fractions of the same ``total`` items (e.g. ``clip_frac`` of
    ``num_tokens``): their counts differ by at most ``boundary`` items."""
    count_a, count_b = whole_count(a, total), whole_count(b, total)
    assert abs(count_a - count_b) <= boundary, (
        *context,
        f"counts {count_a} vs {count_b} of {total:g} differ by more than {boundary} boundary item(s)",
    )


def assert_close(a: float, b: float, *, rel: float, abs_tol: float = 0.0, context: tuple[Hashable, ...] = ()) -> None:
    """``|a - b| <= rel * max(1, |a|) + abs_tol`` (``rel`` acts as an absolute tolerance for
    values below 1, whose relative rounding error is not smaller than that of 1)."""
    assert abs(a - b) <= rel * max(1.0, abs(a)) + abs_tol, (*context, a, b, abs(a - b))


def perturb(tensor: torch.Tensor, rel: float = 1e-7, seed: int = 0) -> torch.Tensor:
    """``tensor`` with each element scaled by ``1 + rel * N(0, 1)``: a rounding-level change of the
    kind another CPU's kernels or another reduction order makes (fp32 has 2**-24 ~ 6e-8)."""
    noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (tensor.double() * (1.0 + rel * noise)).to(tensor.dtype)
