"""`WeightReceiver.release`: a colocated serving model frees its weights between uses and the next version
re-materialises them. After release no weight holds storage (every parameter and persistent buffer is one
shared NaN element expanded to its shape); the next version's weights are exactly what a receiver that never released would serve, through
every apply path (in memory with and without storage swapping, cast to another dtype, from disk); a version
that does not carry every released tensor is refused and leaves the model released."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardforge.weight_sync import (
    DiskTransport,
    DiskWeightSource,
    InProcessTransport,
    WeightPublisher,
    WeightReceiver,
    WeightVersionError,
)


class Net(nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor([1.0, 2.0]))
        self.register_buffer("table", torch.arange(3.0), persistent=False)  # in no version: kept


def _net(seed: int, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    net = Net().to(dtype)
    with torch.no_grad():
        net.count.add_(seed)
    return net


def _tensor_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and persistent buffers (tied weights once)."""
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_bytes(model: nn.Module) -> int:
    """Bytes of the storages behind the parameters and persistent buffers (each storage once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in model.state_dict(keep_vars=True).values()}
    return sum(s.nbytes() for s in storages.values())


def _equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    ("swap", "dtype"), [(True, None), (False, None), (True, torch.bfloat16)], ids=["swap", "copy", "cast"]
)
def test_released_weights_come_back_as_the_next_version(swap: bool, dtype: torch.dtype | None) -> None:
    serving_dtype = dtype or torch.float32
    released, control = _net(5, serving_dtype), _net(5, serving_dtype)
    receivers = [WeightReceiver(m, swap_storage=swap) for m in (released, control)]
    x = torch.tensor([1, 2, 3])
    for version, seed in ((1, 1), (2, 2), (3, 3)):
        trainer = _net(seed)
        freed = receivers[0].release()
        # One shared element (NaN) expanded to every shape: nothing of the weights is held.
        assert receivers[0].released and freed == _tensor_bytes(control) > 0
        assert _storage_bytes(released) == torch.finfo(serving_dtype).bits // 8
        assert torch.equal(released.table, torch.arange(3.0)), "non-persistent buffers are in no version: they stay"
        assert torch.isnan(released.head(released.hidden(released.embed(x)))).all(), "a forward must not look valid"
        for receiver in receivers:
            publisher = WeightPublisher(trainer, InProcessTransport(receiver), bucket_bytes=64, dtype=dtype)
            publisher.publish(version)
        assert not receivers[0].released and receivers[0].version == version
        assert _equal(released, control), f"version {version} differs from the never-released receiver's"
        assert released.head.weight is released.embed.weight, "tied weights stay one tensor"
        assert released.count.device.type == "cpu" and released.count.dtype == serving_dtype
        if not swap:  # the receiver's weights must not alias the publisher's buffers
            assert all(p.data_ptr() != q.data_ptr() for p, q in zip(released.parameters(), trainer.parameters()))


def test_release_then_disk_version_and_idempotent_release(tmp_path: Path) -> None:
    transport = DiskTransport(tmp_path, keep_last=3)
    WeightPublisher(_net(1), transport, bucket_bytes=48).publish(1)
    source = DiskWeightSource(tmp_path)
    receiver = WeightReceiver(_net(9))
    assert receiver.release() > 0 and receiver.release() == 0, "releasing twice frees nothing more"
    manifest = source.manifest(1)
    receiver.apply(manifest, source.tensors(manifest))
    assert _equal(receiver.model, _net(1))


def test_a_version_without_every_released_weight_is_refused(tmp_path: Path) -> None:
    trainer, serving = _net(1), _net(2)
    partial = nn.Module()  # a version of the hidden layer only: the rest would stay unmaterialised
    partial.hidden = trainer.hidden
    transport = DiskTransport(tmp_path, keep_last=3)
    WeightPublisher(partial, transport).publish(1)
    WeightPublisher(trainer, transport).publish(2)
    source = DiskWeightSource(tmp_path)
    receiver = WeightReceiver(serving)
    receiver.release()
    with pytest.raises(WeightVersionError, match=r"version 1 lacks released weights \['count', 'embed.weight'"):
        receiver.apply(source.manifest(1), source.tensors(source.manifest(1)))
    assert receiver.released and receiver.version == 0 and _storage_bytes(serving) == 4
    receiver.apply(source.manifest(2), source.tensors(source.manifest(2)))
    assert _equal(serving, trainer) and receiver.version == 2
