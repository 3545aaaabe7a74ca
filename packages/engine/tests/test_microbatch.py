"""Token-budget micro-batching: first-fit-decreasing bins and splitting to an agreed count."""

from __future__ import annotations

import random

import pytest

from shardforge.engine import ffd_bins, pack_sequences, split_microbatches
from shardforge.engine.batching.microbatch import _split_to_count, agree_max


@pytest.mark.parametrize("seed", range(5))
def test_ffd_bins_respect_budget_and_cover_every_index_once(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 60))]
    budget = 40
    bins = ffd_bins(lengths, budget)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    assert all(b == sorted(b) for b in bins), "indices inside a bin keep their original order"
    assert [b[0] for b in bins] == sorted(b[0] for b in bins), "bins are ordered by first index"
    # FFD never needs more than 11/9 OPT + 1 bins; OPT >= ceil(sum / budget).
    lower = -(-sum(lengths) // budget)
    assert len(bins) <= 11 * lower / 9 + 1


def test_ffd_packs_a_known_example_optimally():
    # Decreasing: 6 -> A, 5 -> B, 4 -> C, 3 -> B (8), 2 -> A (8), 2 -> C (6). 22 tokens / 8 = 3 bins.
    lengths = [2, 6, 5, 2, 4, 3]
    assert ffd_bins(lengths, 8) == [[0, 1], [2, 5], [3, 4]]


def test_ffd_single_bin_when_everything_fits():
    assert ffd_bins([3, 1, 2], 100) == [[0, 1, 2]]


def test_ffd_sequence_of_exactly_budget_fits():
    assert ffd_bins([4, 4], 4) == [[0], [1]]


def test_ffd_too_long_sequence_names_the_fix():
    with pytest.raises(ValueError) as info:
        ffd_bins([3, 20, 25], 16)
    message = str(info.value)
    assert "sequence 1 has 20 tokens" in message
    assert "2 sequence(s) too long" in message
    assert "max_tokens_per_microbatch to >= 25" in message
    assert "max_seq_len" in message


def test_ffd_rejects_non_positive_budget():
    with pytest.raises(ValueError, match="budget must be >= 1"):
        ffd_bins([1], 0)


def test_split_microbatches_without_group():
    batch = pack_sequences([[1] * 6, [2] * 5, [3] * 4, [4] * 3])
    pairs = split_microbatches(batch, 8)
    assert [indices for indices, _ in pairs] == [[0], [1, 3], [2]]
    for indices, mb in pairs:
        assert mb is not None
        assert mb.num_tokens <= 8
        assert mb.input_ids.tolist() == [t for i in indices for t in [i + 1] * batch.seq_lens[i]]
        assert mb.position_ids.tolist() == [p for i in indices for p in range(batch.seq_lens[i])]


def test_split_microbatches_min_count_splits_bins():
    batch = pack_sequences([[1, 1], [2, 2], [3, 3]])
    pairs = split_microbatches(batch, 100, min_count=2)
    assert len(pairs) == 2
    assert sorted(i for indices, _ in pairs for i in indices) == [0, 1, 2]
    assert all(mb is not None for _, mb in pairs)


def test_split_microbatches_pads_with_empty_ones_when_count_exceeds_sequences():
    batch = pack_sequences([[1, 1], [2, 2]])
    pairs = split_microbatches(batch, 100, min_count=4)
    assert len(pairs) == 4
    assert [mb is None for _, mb in pairs] == [False, False, True, True]
    assert [indices for indices, _ in pairs][2:] == [[], []]


def test_split_to_count_halves_the_fullest_bin():
    lengths = [5, 5, 1, 1, 1]
    bins = _split_to_count([[0, 1], [2, 3, 4]], lengths, 3)
    # [0, 1] carries 10 tokens against 3 for [2, 3, 4], so it is the one split.
    assert bins == [[2, 3, 4], [0], [1]]


def test_split_to_count_repeats_until_count():
    bins = _split_to_count([[0, 1, 2, 3]], [1, 1, 1, 1], 4)
    assert sorted(bins) == [[0], [1], [2], [3]]


def test_split_to_count_adds_empty_bins_with_fewer_sequences_than_count():
    assert _split_to_count([[0], [1]], [3, 3], 4) == [[0], [1], [], []]


def test_split_to_count_does_not_modify_input():
    bins = [[0, 1]]
    _split_to_count(bins, [1, 1], 2)
    assert bins == [[0, 1]]


def test_agree_max_without_group_is_identity():
    assert agree_max(7, None) == 7
