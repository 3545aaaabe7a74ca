"""`WeightPublisher`: gather a sharded model bucket by bucket and push it through a transport.

The gather of bucket k+1 (collectives on all trainer ranks) overlaps with the transfer of
bucket k (a background thread on the sending rank). The sender hands bucket k+1 over only
once bucket k has been sent, so its extra memory is at most two buckets: the one in
transfer and the one being gathered.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardforge.weight_sync.buckets import Bucket, iter_buckets
from shardforge.weight_sync.manifest import CHECKSUM_ALGORITHMS, Manifest, TensorInfo, tensor_checksum

__all__ = ["PublishStats", "WeightPublisher", "WeightTransport"]


class WeightTransport(Protocol):
    """How buckets leave the sending rank (disk, a process group, an inference engine)."""

    def begin(self, version: int) -> None: ...
    def send(self, bucket: Bucket) -> None: ...
    def commit(self, manifest: Manifest) -> None: ...
    def abort(self) -> None: ...


@dataclass(frozen=True)
class PublishStats:
    version: int
    bytes: int
    buckets: int
    seconds: float
    max_bucket_bytes: int


class WeightPublisher:
    """Publish ``model``'s weights as numbered versions. Construct on every trainer rank.

    Args:
        transport: used on ``src_rank`` only (other ranks may pass None); ``src_rank=None``: every rank
            receives the full weights and sends them through its own transport (an in-process
            engine per trainer rank).
        bucket_bytes: target size of one bucket.
        dtype: cast floating-point tensors (e.g. fp32 master -> bf16 serving).
        checksums: record a checksum per tensor in the manifest (receivers verify them):
            ``"crc32"`` (default, fast), ``"sha256"``, or False/None for none. Computed on
            the gathering thread while the previous bucket is being sent.
        reuse_buffers: gather into two flat buffers reused in turn (saves the page faults of a
            fresh buffer per bucket). Transports must not keep references to a bucket after
            ``send`` returns (all of ours copy or write it); pass False for one that does.
    """

    def __init__(
        self,
        model: nn.Module,
        transport: WeightTransport | None,
        *,
        bucket_bytes: int = 256 * 1024**2,
        dtype: torch.dtype | None = None,
        src_rank: int | None = 0,
        checksums: bool | str | None = "crc32",
        reuse_buffers: bool = True,
    ) -> None:
        self.model = model
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.src_rank = src_rank
        if checksums is True:
            checksums = "crc32"
        if checksums and checksums not in CHECKSUM_ALGORITHMS:
            raise ValueError(f"checksums={checksums!r}; valid: {CHECKSUM_ALGORITHMS} or False")
        self.checksums: str | None = checksums or None
        self.reuse_buffers = reuse_buffers
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.is_sender = src_rank is None or rank == src_rank
        if self.is_sender and transport is None:
            raise ValueError(f"rank {rank} is the sending rank (src_rank={src_rank}) and needs a transport")

    def publish(self, version: int) -> PublishStats | None:
        """Publish one version (collective over the trainer ranks); stats on the sender."""
        start = time.perf_counter()
        buckets = iter_buckets(
            self.model,
            self.bucket_bytes,
            src_rank=self.src_rank,
            dtype=self.dtype,
            # A transport that keeps buckets past send (InProcessTransport) needs a fresh buffer each.
            ring=2 if self.reuse_buffers and not getattr(self.transport, "keeps_buckets", False) else 0,
        )
        if not self.is_sender:
            for _ in buckets:
                pass
            return None
        transport = self.transport
        assert transport is not None
        transport.begin(version)
        manifest = Manifest(version=version)
        pending: queue.Queue[Bucket | None] = queue.Queue(maxsize=1)
        failure: list[BaseException] = []

        def writer() -> None:
            while True:
                item = pending.get()
                try:
                    if item is None:
                        return
                    if not failure:  # after an error, drain without sending
                        transport.send(item)
                except BaseException as exc:
                    failure.append(exc)
                finally:
                    item = None  # drop the sent bucket before reporting it done
                    pending.task_done()

        thread = threading.Thread(target=writer, name="weight-sync-writer", daemon=True)
        thread.start()
        total = max_bucket = count = 0
        raised = True
        try:
            for bucket in buckets:
                assert bucket is not None
                if failure:
                    continue  # keep joining the gathers: the other ranks are still in them
                # Hash here, while the transfer thread still sends the previous bucket (its I/O
                # or collective overlaps this CPU work).
                manifest.tensors.extend(self._describe(bucket))
                total += bucket.nbytes
                max_bucket = max(max_bucket, bucket.nbytes)
                count += 1
                pending.join()  # wait until the previous bucket is sent: at most two buckets alive
                pending.put(bucket)
            raised = False
        finally:
            pending.put(None)
            thread.join()
            if raised or failure:
                transport.abort()
        if failure:
            raise RuntimeError(f"publishing version {version} failed; the previous version stays live") from failure[0]
        manifest.num_buckets = count
        transport.commit(manifest)
        return PublishStats(version, total, count, time.perf_counter() - start, max_bucket)

    def _describe(self, bucket: Bucket) -> list[TensorInfo]:
        infos = []
        for name, tensor in zip(bucket.names, bucket.tensors):
            checksum = tensor_checksum(tensor, self.checksums) if self.checksums else ""
            infos.append(TensorInfo(name, tuple(tensor.shape), str(tensor.dtype), bucket.index, checksum))
        return infos
