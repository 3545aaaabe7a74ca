"""`InProcessTransport`: a version published in the same process reaches the receiver's model
without disk, across many buckets (no bucket buffer reused while the version is in flight), and
the receiver's version checks still apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardforge.weight_sync import InProcessTransport, WeightPublisher, WeightReceiver, WeightVersionError


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_in_process_publish_matches_the_trainer_weights(dtype: torch.dtype | None) -> None:
    trainer, serving = _net(0), _net(1).to(dtype or torch.float32)
    receiver = WeightReceiver(serving)
    # 256-byte buckets: every tensor in its own bucket, so a reused two-buffer ring would have
    # overwritten the first buckets' tensors before commit.
    publisher = WeightPublisher(trainer, InProcessTransport(receiver), bucket_bytes=256, dtype=dtype, checksums=None)
    stats = publisher.publish(1)
    assert stats is not None and stats.buckets >= 4
    assert receiver.version == 1
    for (name, want), got in zip(trainer.state_dict().items(), serving.state_dict().values(), strict=True):
        assert torch.equal(got, want.to(got.dtype)), name
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1.0)
    publisher.publish(2)
    assert receiver.version == 2
    assert torch.equal(serving[0].weight, trainer[0].weight.to(serving[0].weight.dtype))
    # The serving weights do not alias the trainer's (a trainer update must not leak into the rollouts).
    with torch.no_grad():
        trainer[0].weight.add_(1.0)
    assert not torch.equal(serving[0].weight, trainer[0].weight.to(serving[0].weight.dtype))
    with pytest.raises(RuntimeError, match=r"failed|stale|duplicate") as info:
        publisher.publish(2)
    assert isinstance(info.value, WeightVersionError) or isinstance(info.value.__cause__, WeightVersionError)
    assert receiver.version == 2
