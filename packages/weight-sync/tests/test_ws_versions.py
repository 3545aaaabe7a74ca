"""Version numbers: the transport only moves forward, receivers refuse stale and duplicate
versions, and pruning keeps the newest ``keep_last`` versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardforge.weight_sync import (
    DiskTransport,
    DiskWeightSource,
    Manifest,
    WeightPublisher,
    WeightReceiver,
    WeightVersionError,
)


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))


def _publish(root: Path, version: int, seed: int, *, keep_last: int = 2) -> nn.Module:
    model = _net(seed)
    WeightPublisher(model, DiskTransport(root, keep_last=keep_last), bucket_bytes=40).publish(version)
    return model


def test_begin_rejects_versions_not_newer_than_committed(tmp_path: Path) -> None:
    _publish(tmp_path, 3, seed=0)
    transport = DiskTransport(tmp_path)  # a fresh transport reads the committed state from disk
    for stale in (3, 2, 0):
        with pytest.raises(WeightVersionError, match=f"version {stale} is not newer than the published version 3"):
            transport.begin(stale)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir()), "a rejected begin writes nothing"
    with pytest.raises(WeightVersionError, match="version 3 is not newer"):
        WeightPublisher(_net(0), transport).publish(3)  # refused before any gather
    transport.begin(4)
    assert (tmp_path / ".tmp-v00000004").is_dir()
    transport.abort()
    assert DiskWeightSource(tmp_path).versions() == [3]


def test_receiver_rejects_stale_and_duplicate_versions(tmp_path: Path) -> None:
    for version, seed in ((1, 1), (2, 2), (3, 3)):
        _publish(tmp_path, version, seed, keep_last=3)
    source = DiskWeightSource(tmp_path)
    assert source.versions() == [1, 2, 3]
    model = _net(9)
    receiver = WeightReceiver(model)
    manifest = source.manifest(2)
    receiver.apply(manifest, source.tensors(manifest))
    assert receiver.version == 2
    v2 = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(v2[k], _net(2).state_dict()[k]) for k in v2)

    cases = [(2, "duplicate version 2: this receiver already serves version 2"), (1, "stale version 1")]
    for version, message in cases:
        manifest = source.manifest(version)
        with pytest.raises(WeightVersionError, match=message):
            receiver.apply(manifest, source.tensors(manifest))
        assert receiver.version == 2
        assert all(torch.equal(v, v2[k]) for k, v in model.state_dict().items()), "weights unchanged"

    manifest = source.manifest(3)
    receiver.apply(manifest, source.tensors(manifest))
    assert receiver.version == 3
    assert all(torch.equal(v, _net(3).state_dict()[k]) for k, v in model.state_dict().items())


def test_receiver_starting_version() -> None:
    receiver = WeightReceiver(_net(0), version=5)
    with pytest.raises(WeightVersionError, match="stale version 4: this receiver already serves version 5"):
        receiver.apply(Manifest(version=4), [])
    assert receiver.version == 5


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_keep_last_prunes_oldest_never_newest(tmp_path: Path, keep_last: int) -> None:
    for version in range(1, 6):
        _publish(tmp_path, version * 10, seed=version, keep_last=keep_last)
        versions = DiskWeightSource(tmp_path).versions()
        assert versions[-1] == version * 10, "the newest version is always kept"
        expected = [v * 10 for v in range(1, version + 1)][-keep_last:]
        assert versions == expected
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"v{v:08d}" for v in expected]
    source = DiskWeightSource(tmp_path)
    with pytest.raises(WeightVersionError, match="version 10 is not committed"):
        source.manifest(10)  # pruned


def test_keep_last_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        DiskTransport(tmp_path, keep_last=0)


def test_source_ignores_uncommitted_and_foreign_directories(tmp_path: Path) -> None:
    _publish(tmp_path, 1, seed=0)
    (tmp_path / "v00000009").mkdir()  # no COMMITTED marker
    (tmp_path / ".tmp-v00000010").mkdir()
    (tmp_path / "config").mkdir()
    source = DiskWeightSource(tmp_path)
    assert source.versions() == [1] and source.latest() == 1
    assert DiskWeightSource(tmp_path / "missing").versions() == []
    assert DiskWeightSource(tmp_path / "missing").latest() is None
