"""The sender's extra memory is bounded by two buckets: the one being transferred and the
one being gathered. A deliberately slow transport lets the publisher run ahead as far as it
is allowed to; at every send we count the `Bucket` objects alive in the process."""

from __future__ import annotations

import gc
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.mesh.testing import get_rank_pool
from shardforge.weight_sync import Bucket, DiskTransport, WeightPublisher

TENSORS = 8
BUCKET_BYTES = 2 * 12 * 12 * 4  # two 12x12 fp32 weights per bucket
SEND_DELAY_S = 0.04


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(12, 12, bias=False) for _ in range(TENSORS))


def _live_buckets(baseline: set[int]) -> list[Bucket]:
    return [o for o in gc.get_objects() if type(o) is Bucket and id(o) not in baseline]


class SlowCountingTransport(DiskTransport):
    """Sleeps in every send (a slow link), then records the buckets alive in this process."""

    def __init__(self, root: Any) -> None:
        super().__init__(root)
        self.samples: list[tuple[int, int]] = []
        self.baseline: set[int] = set()
        self._keep: list[object] = []

    def begin(self, version: int) -> None:
        gc.collect()
        self._keep = [o for o in gc.get_objects() if type(o) is Bucket]  # keeps their ids unique
        self.baseline = {id(o) for o in self._keep}
        super().begin(version)

    def send(self, bucket: Bucket) -> None:
        # A slow link: wait until the publisher has gathered the next bucket (there is one
        # after every bucket but the last), then give it time to run further ahead.
        deadline = time.monotonic() + 10.0
        alive = _live_buckets(self.baseline)
        while bucket.index < TENSORS // 2 - 1 and len(alive) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
            alive = _live_buckets(self.baseline)
        time.sleep(SEND_DELAY_S)
        later = _live_buckets(self.baseline)
        assert any(b is bucket for b in alive) and any(b is bucket for b in later)
        worst = max(alive, later, key=lambda group: (len(group), sum(b.nbytes for b in group)))
        self.samples.append((len(worst), sum(b.nbytes for b in worst)))
        del alive, later, worst
        super().send(bucket)


def _check(samples: list[tuple[int, int]], buckets: int) -> None:
    assert len(samples) == buckets == TENSORS // 2
    counts = [n for n, _ in samples]
    assert max(counts) <= 2, f"more than two buckets alive on the sender: {counts}"
    assert max(nbytes for _, nbytes in samples) <= 2 * BUCKET_BYTES
    assert max(counts) == 2, f"the next bucket should be gathered while one is sent: {counts}"


def test_sender_holds_at_most_two_buckets(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Stack()
    transport = SlowCountingTransport(tmp_path)
    publisher = WeightPublisher(model, transport, bucket_bytes=BUCKET_BYTES, checksums=False)
    stats = publisher.publish(1)
    assert stats is not None and stats.max_bucket_bytes == BUCKET_BYTES
    _check(transport.samples, stats.buckets)
    assert _live_buckets(transport.baseline) == [], "no bucket outlives publish()"


def rank_memory(root: str) -> list[tuple[int, int]] | None:
    from torch.distributed.fsdp import fully_shard

    from shardforge.mesh import ParallelDims, build_mesh

    torch.manual_seed(0)
    model = Stack()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = build_mesh(ParallelDims(dp_shard=2), device_type="cpu").get("fsdp")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    transport = SlowCountingTransport(root) if dist.get_rank() == 0 else None
    stats = WeightPublisher(model, transport, bucket_bytes=BUCKET_BYTES).publish(1)
    if transport is None:
        return None
    assert stats is not None
    _check(transport.samples, stats.buckets)
    return transport.samples


def test_fsdp2_sender_holds_at_most_two_buckets(tmp_path: Path) -> None:
    samples = get_rank_pool(2).run(rank_memory, str(tmp_path), timeout_s=90)
    assert samples[0] is not None and samples[1] is None
