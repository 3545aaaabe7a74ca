"""Failure semantics: a publish that fails part-way (a transport error, or the sending
process dying) never commits a partial version, receivers stay on the previous one, the
next publish succeeds and cleans up, and the other trainer ranks are not left hanging.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardforge.mesh.testing import get_rank_pool
from shardforge.weight_sync import (
    Bucket,
    DiskTransport,
    DiskWeightSource,
    Manifest,
    WeightPublisher,
    WeightReceiver,
    WeightVersionError,
)

BUCKET_BYTES = 64


class Net(nn.Module):
    """Six 16-float tensors: six 64-byte buckets at BUCKET_BYTES."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(6))


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


class FailingTransport(DiskTransport):
    """A DiskTransport whose ``fail_at``-th send (1-based, counted per publish) raises."""

    def __init__(self, root: Any, fail_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.fail_at = fail_at
        self.sent = 0
        self.aborts = 0

    def begin(self, version: int) -> None:
        self.sent = 0
        super().begin(version)

    def send(self, bucket: Bucket) -> None:
        self.sent += 1
        if self.fail_at is not None and self.sent == self.fail_at:
            raise OSError(f"disk full while writing bucket {bucket.index}")
        super().send(bucket)

    def abort(self) -> None:
        self.aborts += 1
        super().abort()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _apply_latest(receiver: WeightReceiver, source: DiskWeightSource) -> None:
    latest = source.latest()
    if latest is not None and latest > receiver.version:
        manifest = source.manifest(latest)
        receiver.apply(manifest, source.tensors(manifest))


def test_failing_send_aborts_and_keeps_previous_version(tmp_path: Path) -> None:
    trainer = _net(0)
    transport = FailingTransport(tmp_path)
    publisher = WeightPublisher(trainer, transport, bucket_bytes=BUCKET_BYTES)
    assert publisher.publish(1).buckets == 6  # type: ignore[union-attr]
    v1 = _state(trainer)

    source = DiskWeightSource(tmp_path)
    receiver = WeightReceiver(_net(1))
    _apply_latest(receiver, source)
    assert receiver.version == 1 and _equal(_state(receiver.model), v1)

    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-2.0)
    transport.fail_at = 3
    with pytest.raises(RuntimeError, match="publishing version 2 failed") as info:
        publisher.publish(2)
    assert isinstance(info.value.__cause__, OSError) and "bucket 2" in str(info.value.__cause__)
    assert transport.aborts == 1
    assert transport.sent == 3, "no bucket is sent after the failure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001"], "abort removed the partial version"
    assert source.versions() == [1] and source.latest() == 1
    with pytest.raises(WeightVersionError, match="not committed"):
        source.manifest(2)
    _apply_latest(receiver, source)
    assert receiver.version == 1 and _equal(_state(receiver.model), v1)

    transport.fail_at = None
    stats = publisher.publish(2)  # the same version number is free again
    assert stats is not None and stats.version == 2 and transport.aborts == 1
    assert source.versions() == [1, 2]
    _apply_latest(receiver, source)
    assert receiver.version == 2 and _equal(_state(receiver.model), _state(trainer))


def test_failure_in_the_gather_also_aborts(tmp_path: Path) -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            yield from super().named_parameters(*args, **kwargs)
            raise RuntimeError("gather failed")

    transport = FailingTransport(tmp_path)
    with pytest.raises(RuntimeError, match="gather failed"):
        WeightPublisher(Boom(), transport, bucket_bytes=16).publish(1)
    assert transport.aborts == 1
    assert list(tmp_path.iterdir()) == [], "no temporary directory is left behind"


def test_sender_needs_a_transport() -> None:
    with pytest.raises(ValueError, match="needs a transport"):
        WeightPublisher(_net(0), None)


# ----------------------------------------------------------------------------- multi-rank


def rank_failing_transport(root: str) -> dict[str, Any]:
    """Rank 0's transport fails on the 3rd bucket of version 2; both ranks go on to publish
    version 3, which must be the model's exact full state (the gathers stayed in lockstep)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from shardforge.mesh import ParallelDims, build_mesh

    rank = dist.get_rank()
    model = _net(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = build_mesh(ParallelDims(dp_shard=2), device_type="cpu").get("fsdp")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    transport = FailingTransport(root) if rank == 0 else None
    publisher = WeightPublisher(model, transport, bucket_bytes=BUCKET_BYTES)
    publisher.publish(1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    error = None
    if transport is not None:
        transport.fail_at = 3
    try:
        publisher.publish(2)
    except RuntimeError as exc:
        error = str(exc)
    versions_after_failure = DiskWeightSource(root).versions()
    dist.barrier()
    if transport is not None:
        transport.fail_at = None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    publisher.publish(3)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {
        "error": error,
        "aborts": transport.aborts if transport else None,
        "after_failure": versions_after_failure,
        "full": full,
    }


def test_failing_transport_on_fsdp2_keeps_ranks_in_lockstep(tmp_path: Path) -> None:
    root = str(tmp_path / "weights")
    rank0, rank1 = get_rank_pool(2).run(rank_failing_transport, root, timeout_s=90)
    assert rank0["error"] is not None and "publishing version 2 failed" in rank0["error"]
    assert rank0["aborts"] == 1
    assert rank1["error"] is None, "only the sender sees the transport error"
    assert rank0["after_failure"] == [1] and rank1["after_failure"] == [1]
    source = DiskWeightSource(root)
    assert source.versions() == [1, 3]
    manifest = source.manifest(3)
    received = dict(source.tensors(manifest))
    assert received.keys() == rank0["full"].keys()
    for name, tensor in received.items():
        assert torch.equal(tensor, rank0["full"][name]), name


# ----------------------------------------------------------------------------- a crash

CRASHING_SENDER = textwrap.dedent(
    """
    import os
    import sys

    import torch
    from torch import nn

    from shardforge.weight_sync import DiskTransport, WeightPublisher

    class Dies(DiskTransport):
        sent = 0

        def send(self, bucket):
            self.sent += 1
            if self.sent == 3:
                os._exit(17)  # the process dies mid-version: no abort, no cleanup
            super().send(bucket)

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(6)])
    torch.save(model.state_dict(), sys.argv[2])
    WeightPublisher(model, DiskTransport(sys.argv[1]), bucket_bytes=64).publish(1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    WeightPublisher(model, Dies(sys.argv[1]), bucket_bytes=64).publish(2)
    print("unreachable")
    """
)


def test_sender_killed_mid_publish_leaves_no_partial_version(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    v1_file = tmp_path / "v1.pt"
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_SENDER, str(root), str(v1_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 17, proc.stdout + proc.stderr
    assert "unreachable" not in proc.stdout
    leftover = root / ".tmp-v00000002"
    assert leftover.is_dir() and len(list(leftover.glob("bucket_*.safetensors"))) >= 1, "died part-way"
    assert not (root / "v00000002").exists()

    source = DiskWeightSource(root)
    assert source.versions() == [1] and source.latest() == 1
    with pytest.raises(WeightVersionError, match="not committed"):
        source.manifest(2)
    v1 = torch.load(v1_file, weights_only=True)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(6)])
    receiver = WeightReceiver(model)
    _apply_latest(receiver, source)
    assert receiver.version == 1 and _equal(_state(model), v1)

    # A restarted trainer publishes the next version; the abandoned directory is cleaned up.
    restarted = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(6)])
    stats = WeightPublisher(restarted, DiskTransport(root), bucket_bytes=64).publish(3)
    assert stats is not None and stats.buckets == 6
    assert sorted(p.name for p in root.iterdir()) == ["v00000001", "v00000003"]
    _apply_latest(receiver, source)
    assert receiver.version == 3 and _equal(_state(model), _state(restarted))
    assert isinstance(source.manifest(3), Manifest)
