"""`InProcessTransport`: hand a version straight to a `WeightReceiver` in the same process.

When the serving model lives in the trainer's own process (an embedded rollout engine at world
size 1), writing a version to disk and reading it back is pure overhead. This transport keeps
the published buckets' tensors (the publisher gathers each into a fresh buffer for it, see
``keeps_buckets``) and, on commit, calls ``receiver.apply``: the receiver's checks (names,
shapes, dtypes, monotonic versions) still run, and with ``swap_storage`` the gathered tensors
become the serving weights without a second copy. Memory: one full copy of the published
weights while a version is in flight (the disk transport needs two buckets), which becomes the
serving model's storage.
"""

from __future__ import annotations

import torch

from shardforge.weight_sync.buckets import Bucket
from shardforge.weight_sync.manifest import Manifest
from shardforge.weight_sync.receiver import WeightReceiver

__all__ = ["InProcessTransport"]


class InProcessTransport:
    """A `WeightTransport` whose commit applies the version to ``receiver`` (same process)."""

    keeps_buckets = True
    """The bucket tensors are kept until commit: `WeightPublisher` gives this transport a fresh
    buffer per bucket instead of reusing two."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver
        self._staged: list[tuple[str, torch.Tensor]] | None = None

    def begin(self, version: int) -> None:
        self._staged = []

    def send(self, bucket: Bucket) -> None:
        if self._staged is None:
            raise RuntimeError("InProcessTransport.send before begin")
        self._staged.extend(zip(bucket.names, bucket.tensors, strict=True))

    def commit(self, manifest: Manifest) -> None:
        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("InProcessTransport.commit before begin")
        self.receiver.apply(manifest, staged)

    def abort(self) -> None:
        self._staged = None
