"""The comparison helpers of `shardforge.mesh.testing.parity` on constructed values: a boundary flip is
allowed exactly up to the stated count, whatever CPU rounds the real runs (tests that compare layouts
rely on this and cannot count on a flip happening on the machine they run on)."""

from __future__ import annotations

import pytest
import torch

from shardforge.mesh.testing.parity import assert_close, assert_counts_match, perturb, whole_count


def test_counts_allow_the_stated_boundary_flips_and_no_more() -> None:
    total = 88
    assert_counts_match(5 / total, 5 / total, total, boundary=0)
    assert_counts_match(5 / total, 6 / total, total, boundary=1)  # one token changed side
    assert_counts_match(6 / total, 5 / total, total, boundary=1)
    with pytest.raises(AssertionError, match="differ by more than 1"):
        assert_counts_match(5 / total, 7 / total, total, boundary=1)
    with pytest.raises(AssertionError, match="differ by more than 0"):
        assert_counts_match(5 / total, 6 / total, total, boundary=0)
    # A continuous tolerance would reject the one-token flip (1/88 ~ 0.011 > 1e-5): why counts are compared.
    with pytest.raises(AssertionError):
        assert_close(5 / total, 6 / total, rel=1e-5)


def test_whole_count_refuses_a_wrong_denominator() -> None:
    assert whole_count(0.25, 88) == 22
    assert whole_count(5 / 88 * (1 + 1e-9), 88) == 5  # rounding in the fraction itself is fine
    with pytest.raises(AssertionError, match="not a whole count"):
        whole_count(5 / 88, 90)
    with pytest.raises(AssertionError, match="not a whole count"):
        whole_count(float("nan"), 88)


def test_close_is_absolute_below_one_and_relative_above() -> None:
    assert_close(1e-3, 1e-3 + 9e-6, rel=1e-5)
    with pytest.raises(AssertionError):
        assert_close(1e-3, 1e-3 + 2e-5, rel=1e-5)
    assert_close(1000.0, 1000.009, rel=1e-5)
    with pytest.raises(AssertionError):
        assert_close(1000.0, 1000.02, rel=1e-5)
    assert_close(0.0, 0.5, rel=0.0, abs_tol=0.5)


def test_perturb_is_rounding_sized_and_seeded() -> None:
    x = torch.linspace(-3, 3, 1000)
    a, b = perturb(x, seed=1), perturb(x, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, perturb(x, seed=2))
    ratio = (a.double() / x.double())[x != 0]
    assert (ratio - 1).abs().max() < 1e-6 and (ratio != 1).any()
