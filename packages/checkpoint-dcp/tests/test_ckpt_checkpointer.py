"""`Checkpointer` in one process (no process group): layout, commit marker, retention, async.

The state is a plain dict of tensors here; `TrainState` has its own tests. DCP warns that
it saves "in a single process" without a process group: that is expected and filtered.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from shardforge.checkpoint_dcp import COMMIT_MARKER, Checkpointer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(value: float) -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + value,
        "b": torch.full((5,), value, dtype=torch.float64),
        "i": torch.tensor([int(value), 7], dtype=torch.int64),
    }


def _empty() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state(0.0).items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ---------------------------------------------------------------------------------------------- layout
def test_save_writes_committed_step_dir_and_no_temp(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ckpts", keep_last=None)
    ckpt.save(12, _state(1.0))
    assert _names(ckpt.root) == ["step_00000012"]
    final = ckpt.path(12)
    assert final == ckpt.root / "step_00000012"
    marker = final / COMMIT_MARKER
    assert marker.is_file()
    assert json.loads(marker.read_text())["step"] == 12
    assert (final / ".metadata").is_file()
    assert any(p.suffix == ".distcp" for p in final.iterdir())
    assert not [p for p in ckpt.root.rglob("*") if p.name.startswith(".tmp-")]
    assert ckpt.last_save_blocking_s > 0.0


def test_a_step_saved_again_survives_a_kill_between_the_renames(tmp_path: Path) -> None:
    """Saving a step that exists renames the old directory aside first (`checkpoint_dcp.replace`). What a process
    killed between the two renames leaves (made here with the same renames) is put right by the next Checkpointer:
    the new, committed step in place, the old one removed."""
    ckpt = Checkpointer(tmp_path / "ckpts", keep_last=None)
    ckpt.save(1, _state(1.0))
    ckpt.path(1).rename(ckpt.root / ".old-step_00000001-0123abcd")
    ckpt.save(1, _state(2.0))
    ckpt.path(1).rename(ckpt.root / ".tmp-step_00000001")  # the new one, committed, not yet renamed into place
    assert ckpt.latest_step() is None
    again = Checkpointer(tmp_path / "ckpts", keep_last=None)
    assert _names(again.root) == ["step_00000001"]
    got = _empty()
    assert again.load(got) == 1
    _assert_equal(got, _state(2.0))
    again.save(1, _state(3.0))  # saved again: replaced in place, nothing left aside
    assert _names(again.root) == ["step_00000001"]
    again.load(got)
    _assert_equal(got, _state(3.0))


def test_committed_steps_and_latest(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=None)
    assert ckpt.committed_steps() == []
    assert ckpt.latest_step() is None
    for step in (5, 100, 20):
        ckpt.save(step, _state(float(step)))
    assert ckpt.committed_steps() == [5, 20, 100]
    assert ckpt.latest_step() == 100
    # A second Checkpointer over the same root sees the same (state lives on disk only).
    assert Checkpointer(tmp_path, keep_last=None).committed_steps() == [5, 20, 100]


def test_load_latest_and_explicit_step(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=None)
    ckpt.save(1, _state(1.0))
    ckpt.save(2, _state(2.0))
    got = _empty()
    assert ckpt.load(got) == 2
    _assert_equal(got, _state(2.0))
    got = _empty()
    assert ckpt.load(got, step=1) == 1
    _assert_equal(got, _state(1.0))


def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=None)
    ckpt.save(3, _state(1.0))
    ckpt.save(3, _state(9.0))
    assert _names(tmp_path) == ["step_00000003"]
    got = _empty()
    ckpt.load(got)
    _assert_equal(got, _state(9.0))


def test_directories_without_marker_are_never_loaded(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=None)
    ckpt.save(1, _state(1.0))
    # A newer step directory with real DCP files but no marker (e.g. copied by hand or
    # left by another tool), and a temp dir of an interrupted save.
    ckpt.save(2, _state(2.0))
    os.remove(ckpt.path(2) / COMMIT_MARKER)
    (tmp_path / ".tmp-step_00000003").mkdir()
    (tmp_path / "step_00000004").mkdir()  # empty, no marker
    (tmp_path / "step_5").mkdir()  # not the step_XXXXXXXX pattern
    (tmp_path / "step_5" / COMMIT_MARKER).write_text("{}")

    assert ckpt.committed_steps() == [1]
    assert ckpt.latest_step() == 1
    got = _empty()
    assert ckpt.load(got) == 1
    _assert_equal(got, _state(1.0))
    for step in (2, 3, 4, 5):
        with pytest.raises(FileNotFoundError) as info:
            ckpt.load(_empty(), step=step)
        assert f"step {step}" in str(info.value)
        assert "committed steps: [1]" in str(info.value)


def test_load_uncommitted_step_lists_committed_steps(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=None)
    ckpt.save(10, _state(1.0))
    ckpt.save(30, _state(3.0))
    with pytest.raises(FileNotFoundError, match=r"step 20 .*committed steps: \[10, 30\]"):
        ckpt.load(_empty(), step=20)


def test_load_latest_with_nothing_returns_none(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "fresh")
    got = _empty()
    assert ckpt.load(got) is None
    _assert_equal(got, _empty())  # untouched
    # A root holding only an uncommitted temp dir is still "nothing".
    (tmp_path / "fresh" / ".tmp-step_00000001").mkdir()
    assert ckpt.load(got, step="latest") is None


def test_load_replaces_non_tensor_values_of_a_plain_dict(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"w": torch.ones(3), "count": 5, "meta": {"name": "x"}})
    got = {"w": torch.zeros(3), "count": 0, "meta": {"name": ""}}
    ckpt.load(got)
    assert torch.equal(got["w"], torch.ones(3))
    assert got["count"] == 5
    assert got["meta"] == {"name": "x"}


# ---------------------------------------------------------------------------------------------- retention
def test_keep_last_keeps_the_newest(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=2)
    for step in range(1, 6):
        ckpt.save(step, _state(float(step)))
        assert ckpt.committed_steps() == list(range(max(1, step - 1), step + 1))
    assert _names(tmp_path) == ["step_00000004", "step_00000005"]
    got = _empty()
    assert ckpt.load(got) == 5
    _assert_equal(got, _state(5.0))


def test_keep_last_one_never_deletes_the_newest(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=1)
    ckpt.save(8, _state(8.0))
    assert ckpt.committed_steps() == [8]
    # Saving an older step (e.g. a re-run) must not remove the newest committed checkpoint.
    ckpt.save(3, _state(3.0))
    assert ckpt.committed_steps() == [8]
    got = _empty()
    assert ckpt.load(got) == 8
    _assert_equal(got, _state(8.0))


def test_keep_last_none_keeps_everything(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=None)
    for step in range(4):
        ckpt.save(step, _state(float(step)))
    assert ckpt.committed_steps() == [0, 1, 2, 3]


def test_commit_removes_stale_temp_dirs(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    stale = tmp_path / ".tmp-step_00000007"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    ckpt.save(1, _state(1.0))
    assert _names(tmp_path) == ["step_00000001"]


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("keep_last", [0, -1])
def test_invalid_keep_last(tmp_path: Path, keep_last: int) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=keep_last)


@pytest.mark.parametrize("mode", ["on", "sync", "", "ASYNC"])
def test_invalid_async_mode(tmp_path: Path, mode: str) -> None:
    with pytest.raises(ValueError, match="async_mode") as info:
        Checkpointer(tmp_path, async_mode=mode)  # type: ignore[arg-type]
    assert "'async_pinned'" in str(info.value)


def test_negative_step_rejected(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="step=-1"):
        ckpt.save(-1, _state(1.0))
    assert _names(tmp_path) == []


# ---------------------------------------------------------------------------------------------- async
@pytest.mark.parametrize("mode", ["async", "async_pinned"])
def test_async_matches_sync(tmp_path: Path, mode: str) -> None:
    sync = Checkpointer(tmp_path / "sync", async_mode="off")
    sync.save(4, _state(4.0))
    want = _empty()
    sync.load(want)

    ckpt = Checkpointer(tmp_path / mode, async_mode=mode)
    source = _state(4.0)
    ckpt.save(4, source)
    assert ckpt.last_save_blocking_s > 0.0
    # The final directory never appears without its marker, whenever the commit happens.
    assert not ckpt.path(4).exists() or (ckpt.path(4) / COMMIT_MARKER).is_file()
    # The state was staged: training may mutate it right away without corrupting the save.
    for tensor in source.values():
        tensor.add_(100)
    ckpt.close()
    assert ckpt.committed_steps() == [4]
    assert _names(ckpt.root) == ["step_00000004"]
    got = _empty()
    assert ckpt.load(got) == 4
    _assert_equal(got, want)
    _assert_equal(got, _state(4.0))


def test_async_next_save_and_load_commit_pending(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=None, async_mode="async")
    ckpt.save(1, _state(1.0))
    ckpt.save(2, _state(2.0))  # waits for and commits step 1 first
    assert 1 in ckpt.committed_steps()
    got = _empty()
    assert ckpt.load(got) == 2  # load commits the pending step 2 before choosing "latest"
    _assert_equal(got, _state(2.0))
    assert ckpt.committed_steps() == [1, 2]


def test_async_wait_commits_and_is_idempotent(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, async_mode="async")
    ckpt.wait()  # nothing pending: no-op
    ckpt.save(6, _state(6.0))
    ckpt.wait()
    assert ckpt.committed_steps() == [6]
    ckpt.wait()
    ckpt.close()
    assert _names(tmp_path) == ["step_00000006"]


def test_async_keep_last_applies_on_commit(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=2, async_mode="async")
    for step in range(1, 5):
        ckpt.save(step, _state(float(step)))
    ckpt.close()
    assert ckpt.committed_steps() == [3, 4]
    assert _names(tmp_path) == ["step_00000003", "step_00000004"]


def test_async_save_returns_only_after_staging_completes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With CUDA, "async_pinned" stages in a background thread and DCP returns before the
    # copy is done (AsyncSaveResponse.staging_completion). save() must wait for it, or the
    # next optimizer step would race with the copy. Simulated here with a slow staging future.
    import threading
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    real_async_save = dcp.async_save
    staging: Future[None] = Future()

    def slow_staging_async_save(*args: object, **kwargs: object) -> AsyncSaveResponse:
        upload = real_async_save(*args, **kwargs)  # type: ignore[arg-type]
        threading.Timer(0.5, staging.set_result, args=(None,)).start()
        return AsyncSaveResponse(staging_completion=staging, upload_completion=upload)  # type: ignore[arg-type]

    monkeypatch.setattr(dcp, "async_save", slow_staging_async_save)
    ckpt = Checkpointer(tmp_path, async_mode="async_pinned")
    ckpt.save(1, _state(1.0))
    assert staging.done()
    assert ckpt.last_save_blocking_s >= 0.4
    ckpt.close()
    got = _empty()
    assert ckpt.load(got) == 1
    _assert_equal(got, _state(1.0))


# ---------------------------------------------------------------------------------------------- damage
def _truncate_data_file(step_dir: Path) -> Path:
    data = sorted(p for p in step_dir.iterdir() if p.suffix == ".distcp")[0]
    data.write_bytes(data.read_bytes()[:10])
    return data


def test_truncated_data_file_is_named_and_latest_valid_step_skips_it(tmp_path: Path) -> None:
    from shardforge.checkpoint_dcp import CorruptCheckpointError, verify_files

    ckpt = Checkpointer(tmp_path / "ckpts", keep_last=None)
    ckpt.save(1, _state(1.0))
    ckpt.save(2, _state(2.0))
    verify_files(ckpt.path(2))  # intact: no error
    damaged = _truncate_data_file(ckpt.path(2))
    with pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(_empty())
    message = str(info.value)
    assert str(damaged) in message and "truncated" in message
    assert "resume=latest_valid" in message and "newest older step: 1" in message
    assert ckpt.latest_step() == 2 and ckpt.latest_valid_step() == 1
    state = _empty()
    assert ckpt.load(state, step=ckpt.latest_valid_step()) == 1
    _assert_equal(state, _state(1.0))


def test_unreadable_index_is_named_and_no_valid_step_left(tmp_path: Path) -> None:
    from shardforge.checkpoint_dcp import CorruptCheckpointError

    ckpt = Checkpointer(tmp_path / "ckpts", keep_last=None)
    ckpt.save(3, _state(3.0))
    index = ckpt.path(3) / ".metadata"
    index.write_bytes(index.read_bytes()[:7])
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata cannot be read .*no older committed checkpoint"):
        ckpt.load(_empty())
    assert ckpt.latest_valid_step() is None
