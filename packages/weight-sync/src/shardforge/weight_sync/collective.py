"""Collective transport: broadcast buckets from the sending trainer rank to inference workers.

The sender hosts a `TCPStore` at ``host:port``; each receiver connects to it and all of
them build one gloo (CPU) or NCCL (CUDA) process group of ``1 + num_receivers`` ranks,
separate from the trainer's own groups. Every message is a broadcast from rank 0:

    header int64[3]   (op, a, b)
    BEGIN  (1, version, 0)
    BUCKET (2, index, len(meta))  + meta (JSON: names, shapes, dtypes, byte offsets) + one flat uint8 payload
    COMMIT (3, version, len(manifest)) + manifest JSON
    ABORT  (4, version, 0)

A receiver learns names/shapes/dtypes from each bucket's metadata, stages the tensors and
only switches to the version on COMMIT, after `WeightReceiver` verified it. If the sender
dies mid-version, the receiver's broadcast fails: it drops the staged tensors, keeps
serving the previous version, and waits for the (restarted) sender's next session.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardforge.weight_sync.buckets import Bucket, aligned
from shardforge.weight_sync.manifest import Manifest
from shardforge.weight_sync.receiver import WeightReceiver

__all__ = ["CollectiveReceiver", "CollectiveTransport"]

BEGIN, BUCKET, COMMIT, ABORT = 1, 2, 3, 4
_SESSION_KEY = "shardforge/weight-sync/session"
_EMPTY = torch.empty(0, dtype=torch.uint8)


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in bucket metadata")
    return value


def _make_group(store: dist.Store, session: str, rank: int, world_size: int, timeout_s: float) -> Any:
    prefixed = dist.PrefixStore(f"weights/{session}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    # A standalone process group (not the default one): trainers keep their own world, and
    # inference workers never join it.
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


class _Refused(Exception):
    """The receiver rejected a fully received version (wraps its error)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _Channel:
    def __init__(self, group: Any) -> None:
        self.group = group

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.broadcast([tensor], dist.BroadcastOptions()).wait()
        return tensor

    def send_bytes(self, data: bytes) -> None:
        if data:
            self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def recv_bytes(self, length: int) -> bytes:
        if length == 0:
            return b""
        received = self.broadcast(torch.empty(length, dtype=torch.uint8))
        return ctypes.string_at(received.data_ptr(), length)

    def header(self, op: int = 0, a: int = 0, b: int = 0) -> tuple[int, int, int]:
        values = self.broadcast(torch.tensor([op, a, b], dtype=torch.int64))
        return int(values[0]), int(values[1]), int(values[2])


class CollectiveTransport:
    """Sender side; create it on the sending trainer rank only.

    Args:
        host: where the sender's TCPStore listens (receivers connect here).
        port: the TCPStore's port; ``port=0`` lets the OS pick a free port (no race with other
            processes); read it back from ``transport.port`` and hand it to the receivers.
        num_receivers: inference workers that will join.
        timeout_s: a receiver that stops responding makes a collective fail after this.
    """

    def __init__(self, host: str, port: int, num_receivers: int, *, timeout_s: float = 300.0) -> None:
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers} must be >= 1")
        self.world_size = 1 + num_receivers
        self.store = dist.TCPStore(
            host,
            port,
            self.world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        self.port: int = self.store.port
        self.session = uuid.uuid4().hex
        self.store.set(_SESSION_KEY, self.session)
        self.timeout_s = timeout_s
        self._group: _Channel | None = None

    @property
    def _channel(self) -> _Channel:
        """The weight group, created at first use: building it waits for every receiver, and
        receivers need ``self.port`` (known right after construction) to connect."""
        if self._group is None:
            if self.store is None:
                raise RuntimeError("this CollectiveTransport is closed; create a new one")
            self._group = _Channel(_make_group(self.store, self.session, 0, self.world_size, self.timeout_s))
        return self._group

    def connect(self) -> None:
        """Wait until every receiver has joined (otherwise the first ``begin`` does)."""
        self._channel  # noqa: B018

    def begin(self, version: int) -> None:
        self._channel.header(BEGIN, version, 0)

    def send(self, bucket: Bucket) -> None:
        if bucket.flat is not None:  # built by iter_buckets: the tensors already live in one buffer
            payload, offsets = bucket.flat, list(bucket.offsets)
        else:
            offsets, end = [], 0
            for tensor in bucket.tensors:
                offsets.append(end)
                end = aligned(end + tensor.numel() * tensor.element_size())
            payload = torch.empty(end, dtype=torch.uint8)
            for tensor, offset in zip(bucket.tensors, offsets):
                raw = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8) if tensor.numel() else _EMPTY
                payload[offset : offset + raw.numel()].copy_(raw)
        meta = {
            "names": bucket.names,
            "shapes": [list(t.shape) for t in bucket.tensors],
            "dtypes": [str(t.dtype) for t in bucket.tensors],
            "offsets": offsets,
            "nbytes": payload.numel(),
        }
        encoded = json.dumps(meta).encode()
        self._channel.header(BUCKET, bucket.index, len(encoded))
        self._channel.send_bytes(encoded)
        if payload.numel():
            self._channel.broadcast(payload)

    def commit(self, manifest: Manifest) -> None:
        encoded = manifest.to_json().encode()
        self._channel.header(COMMIT, manifest.version, len(encoded))
        self._channel.send_bytes(encoded)

    def close(self) -> None:
        """Leave the group and stop the TCPStore (its port is free again). Idempotent."""
        self._group = None
        self.store = None  # type: ignore[assignment]

    def __enter__(self) -> CollectiveTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def abort(self) -> None:
        try:
            self._channel.header(ABORT, 0, 0)
        except Exception:  # the channel itself may be what failed
            pass


class CollectiveReceiver:
    """Inference-worker side: joins the sender's group and applies versions to a model.

    Args:
        receiver: the `WeightReceiver` wrapping the serving model.
        rank: this worker's rank in the weight group (1..num_receivers).
    """

    def __init__(
        self,
        receiver: WeightReceiver,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = 300.0,
    ) -> None:
        if not 1 <= rank < world_size:
            raise ValueError(f"receiver rank {rank} must be in [1, {world_size}) (rank 0 is the sender)")
        self.receiver = receiver
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.timeout_s = timeout_s
        self.last_error: BaseException | None = None
        self._channel: _Channel | None = None

    def connect(self) -> None:
        """(Re)join the sender's current session; blocks until the sender is up."""
        store = dist.TCPStore(
            self.host, self.port, self.world_size, is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s)
        )
        session = store.get(_SESSION_KEY).decode()
        self._channel = _Channel(_make_group(store, session, self.rank, self.world_size, self.timeout_s))

    def receive_version(self, on_bucket: Callable[[int], None] | None = None) -> int:
        """Receive one version (BEGIN ... COMMIT) and apply it; return the serving version.

        On ABORT or a broken connection the staged tensors are dropped, the model keeps the
        previous version, the error is kept in ``last_error`` and re-raised.
        """
        if self._channel is None:
            self.connect()
        channel = self._channel
        assert channel is not None
        staged: list[tuple[str, torch.Tensor]] = []
        try:
            op, version, _ = channel.header()
            if op != BEGIN:
                raise RuntimeError(f"expected BEGIN from the sender, got op {op}")
            while True:
                op, a, b = channel.header()
                if op == BUCKET:
                    meta = json.loads(channel.recv_bytes(b))
                    payload = (
                        channel.broadcast(torch.empty(meta["nbytes"], dtype=torch.uint8)) if meta["nbytes"] else None
                    )
                    for name, shape, dtype, offset in zip(
                        meta["names"], meta["shapes"], meta["dtypes"], meta["offsets"]
                    ):
                        torch_dtype = _dtype(dtype)
                        count = 1
                        for dim in shape:
                            count *= dim
                        size = count * torch.empty((), dtype=torch_dtype).element_size()
                        raw = payload[offset : offset + size] if payload is not None and size else _EMPTY
                        # A view into this bucket's payload (freshly allocated per bucket): no copy.
                        staged.append((name, raw.view(torch_dtype).reshape(shape)))
                    if on_bucket is not None:
                        on_bucket(a)
                elif op == COMMIT:
                    manifest = Manifest.from_json(channel.recv_bytes(b).decode())
                    if manifest.version != version:
                        raise RuntimeError(f"COMMIT for version {manifest.version} inside version {version}")
                    try:
                        self.receiver.apply(manifest, staged)
                    except Exception as exc:  # the whole version arrived: the channel is fine
                        raise _Refused(exc) from exc
                    self.last_error = None
                    return self.receiver.version
                elif op == ABORT:
                    raise RuntimeError(f"the sender aborted version {version}")
                else:
                    raise RuntimeError(f"unexpected message op {op} from the sender")
        except _Refused as refused:
            # Verification failed after the whole version arrived: keep the connection (the
            # sender goes on with its next version) and report the receiver's own error.
            self.last_error = refused.error
            raise refused.error from None
        except BaseException as exc:
            self.last_error = exc
            if not isinstance(exc, RuntimeError) or "aborted" not in str(exc):
                self._channel = None  # the group may be broken: rejoin next time
            raise
