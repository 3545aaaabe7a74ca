"""`pack_sequences` and `PackedBatch`: layout, target alignment, selection of sequences."""

from __future__ import annotations

import pytest
import torch

from shardforge.engine import PackedBatch, pack_sequences


def test_pack_concatenates_ids_and_builds_cu_seqlens():
    batch = pack_sequences([[5, 6, 7], [8], [9, 10]])
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert batch.input_ids.dtype == torch.long
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert batch.cu_seqlens.dtype == torch.int32
    assert (batch.num_tokens, batch.num_sequences, batch.seq_lens) == (6, 3, [3, 1, 2])


def test_position_ids_restart_at_every_sequence():
    batch = pack_sequences([[1, 1, 1], [2], [3, 3]])
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 0, 1]


def test_default_mask_is_every_token_but_the_first_of_each_sequence():
    batch = pack_sequences([[1, 2, 3], [4], [5, 6]])
    assert batch.loss_mask.dtype == torch.float32
    assert batch.loss_mask.tolist() == [0, 1, 1, 0, 0, 1]


def test_first_token_mask_is_forced_to_zero_and_the_rest_kept():
    masks = [[1.0, 0.0, 1.0], [1.0, 0.5]]
    batch = pack_sequences([[1, 2, 3], [4, 5]], masks)
    assert batch.loss_mask.tolist() == [0.0, 0.0, 1.0, 0.0, 0.5]
    assert masks == [[1.0, 0.0, 1.0], [1.0, 0.5]], "the caller's masks must not be modified"


def test_mask_tensor_input_is_not_modified_in_place():
    mask = torch.ones(3)
    pack_sequences([[1, 2, 3]], [mask])
    assert mask.tolist() == [1.0, 1.0, 1.0]


def test_empty_list_raises():
    with pytest.raises(ValueError, match="empty list of sequences"):
        pack_sequences([])


def test_empty_sequence_raises_naming_its_index():
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack_sequences([[1, 2], [], [3]])


def test_mask_length_mismatch_raises():
    with pytest.raises(ValueError, match="sequence 1 has 2 tokens but its loss mask has 3"):
        pack_sequences([[1, 2], [3, 4]], [[1, 1], [1, 1, 1]])


def test_mask_count_mismatch_raises():
    with pytest.raises(ValueError, match="2 sequences but 1 loss masks"):
        pack_sequences([[1, 2], [3, 4]], [[1, 1]])


def _batch_with_extras() -> PackedBatch:
    batch = pack_sequences([[10, 11, 12], [20, 21], [30, 31, 32, 33]])
    batch.extras["reward_T"] = torch.arange(9, dtype=torch.float32) * 10  # per token (T = 9)
    batch.extras["advantage_N"] = torch.tensor([1.0, 2.0, 3.0])  # per sequence (N = 3)
    return batch


def test_select_reorders_sequences_and_rebuilds_layout():
    sub = _batch_with_extras().select([2, 0])
    assert sub.input_ids.tolist() == [30, 31, 32, 33, 10, 11, 12]
    assert sub.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert sub.cu_seqlens.tolist() == [0, 4, 7]
    assert sub.loss_mask.tolist() == [0, 1, 1, 1, 0, 1, 1]


def test_select_slices_per_token_and_per_sequence_extras():
    sub = _batch_with_extras().select([2, 0])
    assert sub.extras["reward_T"].tolist() == [50, 60, 70, 80, 0, 10, 20]
    assert sub.extras["advantage_N"].tolist() == [3.0, 1.0]


def test_select_of_one_sequence_keeps_per_sequence_extra_shape():
    sub = _batch_with_extras().select([1])
    assert sub.input_ids.tolist() == [20, 21]
    assert sub.extras["reward_T"].tolist() == [30, 40]
    assert sub.extras["advantage_N"].tolist() == [2.0]


def test_select_rejects_an_extra_of_the_wrong_size():
    batch = _batch_with_extras()
    batch.extras["bad"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"extra 'bad' has leading size 5; expected T=9 \(per token\) or N=3"):
        batch.select([0])


def test_to_keeps_every_field():
    batch = _batch_with_extras().to("cpu")
    assert batch.input_ids.tolist() == [10, 11, 12, 20, 21, 30, 31, 32, 33]
    assert set(batch.extras) == {"reward_T", "advantage_N"}
