"""`checkpoint_dcp.replace` (a folder replaced with no moment where a crash loses both, recovery at the next start)
and `checkpoint_dcp.TrainableState` (trained weights and optimizer state, frozen weights left out), one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from shardforge.checkpoint_dcp import TrainableState, replace
from shardforge.checkpoint_dcp.replace import recover_replacements, replace_folder


def _folder(path: Path, content: str, *, committed: bool = True) -> Path:
    path.mkdir()
    (path / "data").write_text(content)
    if committed:
        (path / "COMMITTED").write_text("{}")
    return path


def _complete(staged: Path) -> bool:
    return (staged / "COMMITTED").is_file()


def test_replace_folder_replaces_and_leaves_nothing_behind(tmp_path: Path) -> None:
    target = _folder(tmp_path / "ckpt", "old")
    replace_folder(_folder(tmp_path / ".tmp-ckpt-0123abcd", "new"), target)
    assert (target / "data").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    replace_folder(_folder(tmp_path / ".tmp-fresh-0123abcd", "first"), tmp_path / "fresh")  # nothing to replace
    assert ((tmp_path / "fresh") / "data").read_text() == "first"


def test_an_error_in_the_second_rename_puts_the_old_folder_back(tmp_path: Path, monkeypatch) -> None:
    target = _folder(tmp_path / "ckpt", "old")
    real, calls = replace.os.replace, []

    def failing(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("device busy")
        return real(src, dst)

    monkeypatch.setattr(replace.os, "replace", failing)
    with pytest.raises(OSError, match="device busy"):
        replace_folder(_folder(tmp_path / ".tmp-ckpt-0123abcd", "new"), target)
    assert (target / "data").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-ckpt-0123abcd", "ckpt"]  # the caller's to delete


@pytest.mark.parametrize("committed", [True, False])
def test_recovery_after_a_kill_between_the_renames(tmp_path: Path, committed: bool) -> None:
    """What a process killed between the renames leaves: the old folder aside, the new one staged (complete or not);
    another folder's save in progress is left alone."""
    _folder(tmp_path / ".old-ckpt-0123abcd", "old")
    _folder(tmp_path / ".tmp-ckpt-89abcdef", "new", committed=committed)
    _folder(tmp_path / ".tmp-other-89abcdef", "other", committed=False)
    assert recover_replacements([tmp_path], _complete) == [tmp_path / "ckpt"]
    assert (tmp_path / "ckpt" / "data").read_text() == ("new" if committed else "old")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (
        [".tmp-other-89abcdef", "ckpt"] if committed else [".tmp-ckpt-89abcdef", ".tmp-other-89abcdef", "ckpt"]
    )


def test_recovery_after_a_kill_before_the_old_folder_was_deleted(tmp_path: Path) -> None:
    _folder(tmp_path / ".old-ckpt-0123abcd", "old")
    _folder(tmp_path / "ckpt", "new")
    assert recover_replacements([tmp_path], _complete) == []
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and (tmp_path / "ckpt" / "data").read_text() == "new"


def test_trainable_state_round_trip_leaves_out_frozen_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)  # the frozen "base"
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    dcp.save({"train": TrainableState(model, optimizer)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state[model[1].weight].items()}

    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    other[0].requires_grad_(False)
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=0.1)
    other(torch.randn(3, 4)).sum().backward()
    other_opt.step()
    frozen = other[0].weight.clone()
    dcp.load({"train": TrainableState(other, other_opt)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(other[1].weight, saved["1.weight"]) and torch.equal(other[1].bias, saved["1.bias"])
    assert torch.equal(other[0].weight, frozen)  # not in the checkpoint: left as it was
    for key, value in moments.items():
        assert torch.equal(other_opt.state[other[1].weight][key], value), key
