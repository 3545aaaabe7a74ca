"""`WeightReceiver` and `DiskWeightSource` verification: every malformed or corrupt version
is refused with `WeightVersionError`, and the serving model keeps its previous weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from shardforge.weight_sync import (
    DiskTransport,
    DiskWeightSource,
    Manifest,
    TensorInfo,
    WeightPublisher,
    WeightReceiver,
    WeightVersionError,
    tensor_checksum,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2, bias=False)
        self.register_buffer("count", torch.tensor([1, 2, 3]))


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    net.count.add_(seed)
    return net


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in now)


@pytest.fixture
def published(tmp_path: Path) -> tuple[DiskWeightSource, WeightReceiver, dict[str, torch.Tensor]]:
    """Version 1 applied to a receiver; version 2 (from a different model) published, not applied."""
    transport = DiskTransport(tmp_path, keep_last=5)
    WeightPublisher(_net(1), transport, bucket_bytes=32).publish(1)
    WeightPublisher(_net(2), transport, bucket_bytes=32).publish(2)
    source = DiskWeightSource(tmp_path)
    receiver = WeightReceiver(_net(7))
    manifest = source.manifest(1)
    receiver.apply(manifest, source.tensors(manifest))
    before = _state(receiver.model)
    assert _unchanged(_net(1), before) and not _unchanged(_net(2), before)
    return source, receiver, before


def _refused(
    receiver: WeightReceiver, before: dict[str, torch.Tensor], manifest: Manifest, stream: object, match: str
) -> None:
    with pytest.raises(WeightVersionError, match=match):
        receiver.apply(manifest, stream)  # type: ignore[arg-type]
    assert receiver.version == 1
    assert _unchanged(receiver.model, before), "a refused version must not touch the weights"


Mutation = Callable[[Manifest, list[tuple[str, torch.Tensor]]], tuple[Manifest, list[tuple[str, torch.Tensor]]]]


def _drop(m: Manifest, s: list[tuple[str, torch.Tensor]]) -> tuple[Manifest, list[tuple[str, torch.Tensor]]]:
    return m, [(n, t) for n, t in s if n != "b.weight"]


def _extra(m: Manifest, s: list[tuple[str, torch.Tensor]]) -> tuple[Manifest, list[tuple[str, torch.Tensor]]]:
    return m, [*s, ("c.weight", torch.zeros(2))]


def _reshape(m: Manifest, s: list[tuple[str, torch.Tensor]]) -> tuple[Manifest, list[tuple[str, torch.Tensor]]]:
    return m, [(n, t.reshape(-1) if n == "a.weight" else t) for n, t in s]


def _retype(m: Manifest, s: list[tuple[str, torch.Tensor]]) -> tuple[Manifest, list[tuple[str, torch.Tensor]]]:
    return m, [(n, t.double() if n == "a.bias" else t) for n, t in s]


def _model_lacks(m: Manifest, s: list[tuple[str, torch.Tensor]]) -> tuple[Manifest, list[tuple[str, torch.Tensor]]]:
    extra = torch.ones(2)
    info = TensorInfo("c.weight", (2,), str(extra.dtype), 0, tensor_checksum(extra))
    return dataclasses.replace(m, tensors=[*m.tensors, info]), [*s, ("c.weight", extra)]


def _model_shape(m: Manifest, s: list[tuple[str, torch.Tensor]]) -> tuple[Manifest, list[tuple[str, torch.Tensor]]]:
    wide = torch.ones(2, 4)  # the model's b.weight is (2, 3)
    infos = [
        TensorInfo(t.name, (2, 4), t.dtype, t.bucket, tensor_checksum(wide)) if t.name == "b.weight" else t
        for t in m.tensors
    ]
    return dataclasses.replace(m, tensors=infos), [(n, wide if n == "b.weight" else t) for n, t in s]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_drop, r"version 2 is incomplete: missing \['b.weight'\]"),
        (_extra, "version 2: unexpected tensor c.weight"),
        (_reshape, r"a.weight arrived as \(12,\) torch.float32, manifest says \(3, 4\) torch.float32"),
        (_retype, r"a.bias arrived as \(3,\) torch.float64, manifest says \(3,\) torch.float32"),
        (_model_lacks, r"version 2 has tensors the model lacks: \['c.weight'\]"),
        (_model_shape, r"version 2: shape mismatch for \['b.weight'\]"),
    ],
    ids=["missing", "unexpected", "shape", "dtype", "model-lacks", "model-shape"],
)
def test_receiver_refuses_malformed_versions(published: tuple, mutate: Mutation, match: str) -> None:
    source, receiver, before = published
    manifest = source.manifest(2)
    stream = list(source.tensors(manifest))
    assert len(stream) == 4
    bad_manifest, bad_stream = mutate(manifest, stream)
    _refused(receiver, before, bad_manifest, iter(bad_stream), match)
    # the receiver still accepts the intact version afterwards
    receiver.apply(manifest, source.tensors(manifest))
    assert receiver.version == 2 and _unchanged(receiver.model, _state(_net(2)))


def test_stream_failing_late_leaves_weights_unchanged(published: tuple) -> None:
    source, receiver, before = published
    manifest = source.manifest(2)

    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        yield from list(source.tensors(manifest))[:-1]
        raise WeightVersionError("connection lost")

    _refused(receiver, before, manifest, broken(), "connection lost")


def _bucket_files(source: DiskWeightSource, version: int) -> list[Path]:
    return sorted((source.root / f"v{version:08d}").glob("bucket_*.safetensors"))


def test_corrupt_bucket_fails_its_checksum(published: tuple) -> None:
    source, receiver, before = published
    files = _bucket_files(source, 2)
    assert len(files) == source.manifest(2).num_buckets > 1
    last = files[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's payload: still a valid safetensors file
    last.write_bytes(bytes(data))
    manifest = source.manifest(2)
    _refused(receiver, before, manifest, source.tensors(manifest), "version 2: checksum mismatch for ")


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_unreadable_bucket_is_a_version_error(published: tuple, damage: str) -> None:
    source, receiver, before = published
    target = _bucket_files(source, 2)[0]
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:20])
    else:
        target.unlink()
    manifest = source.manifest(2)
    _refused(receiver, before, manifest, source.tensors(manifest), "version 2: cannot read .*bucket_00000")


def test_bucket_tensor_not_in_manifest_is_refused(published: tuple) -> None:
    source, receiver, before = published
    manifest = source.manifest(2)
    shrunk = dataclasses.replace(manifest, tensors=[t for t in manifest.tensors if t.name != "a.bias"])
    _refused(receiver, before, shrunk, source.tensors(shrunk), "version 2: a.bias is not in the manifest")


def test_manifest_round_trip_and_checksums() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    info = TensorInfo("x", (2, 3), "torch.float32", 0, tensor_checksum(t))
    manifest = Manifest(version=4, tensors=[info], num_buckets=1)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert tensor_checksum(t) == tensor_checksum(t.t().contiguous().t())  # layout-independent
    assert tensor_checksum(t) != tensor_checksum(t.to(torch.float64))
    bumped = t.clone()
    bumped[1, 2] = torch.nextafter(bumped[1, 2], torch.tensor(100.0))
    assert tensor_checksum(t) != tensor_checksum(bumped)
