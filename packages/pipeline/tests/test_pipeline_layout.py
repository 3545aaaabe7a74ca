"""Stage layouts: balanced and explicit splits, stage placement, schedule names, micro-batch counts."""

from __future__ import annotations

import pytest
import torch

from shardforge.pipeline import (
    balanced_layers_per_stage,
    resolve_schedule,
    split_layers,
    stack_packed_microbatches,
    stage_ids_for_rank,
    trim_cu_seqlens,
    valid_num_microbatches,
)


def test_balanced_split_gives_extra_layers_to_early_stages() -> None:
    assert balanced_layers_per_stage(10, 4) == [3, 3, 2, 2]
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


def test_explicit_layouts() -> None:
    assert split_layers(8, 4, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(6, 2, [4, 2]) == [range(0, 4), range(4, 6)]


def test_uneven_int_layout_proposes_valid_layouts() -> None:
    with pytest.raises(ValueError, match=r"layers_per_stage=2 x 4 stages != 6 layers") as err:
        split_layers(6, 4, 2)
    message = str(err.value)
    assert "balanced: [2, 2, 1, 1]" in message
    assert "stage count in [1, 2, 3, 6]" in message


def test_wrong_list_layout_proposes_balanced() -> None:
    with pytest.raises(ValueError, match=r"sum to 8 .*got 2 counts summing to 7.*balanced: \[4, 4\]"):
        split_layers(8, 2, [4, 3])
    with pytest.raises(ValueError, match="counts >= 1"):
        split_layers(4, 2, [4, 0])


def test_too_many_stages_names_valid_stage_counts() -> None:
    with pytest.raises(ValueError, match=r"cannot split 4 decoder layers into 8 stages.*4 stages x 1 layers"):
        split_layers(4, 8)


def test_stage_placement() -> None:
    assert stage_ids_for_rank(1, 4, 1) == [1]
    assert stage_ids_for_rank(1, 4, 2, "loop") == [1, 5]
    assert stage_ids_for_rank(1, 4, 2, "v") == [1, 6]
    assert stage_ids_for_rank(0, 2, 2, "v") == [0, 3]
    with pytest.raises(ValueError, match="exactly 2 stages"):
        stage_ids_for_rank(0, 2, 3, "v")


def test_schedule_names() -> None:
    assert resolve_schedule("gpipe").name == "GPipe"
    assert resolve_schedule("ZBV").name == "ZBVZeroBubble"
    assert resolve_schedule("interleaved1f1b").multi_stage
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'; valid: \['GPipe', '1F1B'"):
        resolve_schedule("pipedream")


def test_valid_microbatch_counts() -> None:
    assert valid_num_microbatches("1F1B", 4, 2) == 4
    assert valid_num_microbatches("GPipe", 4, 2) == 2
    assert valid_num_microbatches("Interleaved1F1B", 2, 5) == 6  # rounds = 2 must divide the count
    assert valid_num_microbatches("Interleaved1F1B", 4, 3) == 3  # one round: any count


def test_stacking_pads_with_a_separate_sequence() -> None:
    rows = [
        (torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), torch.tensor([0, 3], dtype=torch.int32)),
        (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 0, 1]), torch.tensor([0, 2, 4], dtype=torch.int32)),
    ]
    s = stack_packed_microbatches(rows, 6)
    assert s.input_ids.tolist() == [[5, 6, 7, 0, 0, 0], [1, 2, 3, 4, 0, 0]]
    assert s.position_ids.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 0, 1]]
    assert s.cu_seqlens.tolist() == [[0, 3, 6, 6], [0, 2, 4, 6]]
    assert s.num_tokens == (3, 4)
    assert trim_cu_seqlens(s.cu_seqlens[0:1]).tolist() == [0, 3, 6]
    with pytest.raises(ValueError, match="more than the pipeline's static length 2"):
        stack_packed_microbatches(rows, 2)
