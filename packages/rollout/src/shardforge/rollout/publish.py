"""How a trainer's weights reach a rollout engine: one `WeightPublisher` per built rollout, chosen in one place
(`choose_publisher`, called by `shardforge.rollout.factory.build_rollout`).

- `DiskPublisher`: rank 0 writes each version under ``weights_root`` with weight-sync's `DiskTransport` (atomic,
  verified versions); the engine loads it in `update_weights`. Every engine reads these; asynchronous rollouts need
  them (the generator may still use an older version).
- `InProcessPublisher`: the embedded HF engine lives in the trainer's own processes, so the new weights go straight
  into its `WeightReceiver` (weight-sync's `InProcessTransport`: same manifest and version checks, no disk round
  trip); with several ranks every rank's engine gets the full weights (one all-gather per sharded tensor).
- `DirectPublisher`: engines that receive versions themselves (`PublishesDirectly`: the Ray rollout actors' client,
  a vLLM server over the collective transport) are sent each version through their own ``publish``.

The trainer side is a `WeightSender` (`shardforge.engine.TrainEngine` is one): the rollout package never imports the
engine. Every ``publish`` is collective over the trainer's ranks and returns the version it made available.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from shardforge.mesh.collectives import broadcast_floats
from shardforge.weight_sync import DiskTransport, DiskWeightSource, InProcessTransport, WeightReceiver

__all__ = [
    "DirectPublisher",
    "DiskPublisher",
    "InProcessPublisher",
    "PublishesDirectly",
    "WeightPublisher",
    "WeightSender",
    "choose_publisher",
]


class WeightSender(Protocol):
    """The trainer's side of a publish (`shardforge.engine.TrainEngine` satisfies it)."""

    @property
    def device(self) -> torch.device: ...

    def publish_weights(
        self, transport: Any, version: int | None = None, *, dtype: Any = None, src_rank: int | None = 0,
        checksums: Any = "crc32",
    ) -> Any: ...  # fmt: skip


@runtime_checkable
class PublishesDirectly(Protocol):
    """A rollout engine that receives each version itself (no disk): `choose_publisher` hands it a
    `DirectPublisher`. ``publishes_directly`` may be False for an instance configured to follow disk versions."""

    @property
    def publishes_directly(self) -> bool: ...

    def publish(self, engine: Any, dtype: str, version: int | None) -> int: ...


class WeightPublisher(Protocol):
    """Makes the trainer's current weights a rollout weight version (collective over the trainer's ranks)."""

    def publish(self, sender: WeightSender, version: int | None = None) -> int:
        """Publish ``sender``'s weights as ``version`` (None: the one after the newest already published) and
        return it; when this returns, `RolloutEngine.update_weights(version)` can serve it on every rank."""
        ...


class DiskPublisher:
    """Weight-sync versions on disk under ``root`` (rank 0 writes, every rank waits for the commit).

    Args:
        root: the versions' directory (the engine's ``weights_root``).
        dtype: the dtype the weights are published in (the rollout model's).
        keep_last: committed versions to keep (asynchronous rollouts may need older ones).
    """

    def __init__(self, root: str | os.PathLike[str], dtype: str, *, keep_last: int = 2) -> None:
        self.root, self.dtype, self.keep_last = root, dtype, keep_last
        self._transport: DiskTransport | None = None

    def publish(self, sender: WeightSender, version: int | None = None) -> int:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if version is None:  # a run's first publish continues after any version already on disk, agreed from rank 0
            latest = float(DiskWeightSource(self.root).latest() or 0) if rank == 0 else 0.0
            world = dist.group.WORLD if dist.is_initialized() else None
            version = int(broadcast_floats(latest, src=0, group=world, device=sender.device)[0]) + 1
        if rank == 0 and self._transport is None:
            self._transport = DiskTransport(self.root, keep_last=self.keep_last)
        sender.publish_weights(self._transport if rank == 0 else None, version, dtype=self.dtype)
        if dist.is_initialized():
            dist.barrier()  # committed on disk before any rank's engine looks for it
        return version


class InProcessPublisher:
    """Straight into the in-process engine's `WeightReceiver` on every rank (see the module docstring)."""

    def __init__(self, receiver: WeightReceiver, dtype: str) -> None:
        self.receiver, self.dtype = receiver, dtype

    def publish(self, sender: WeightSender, version: int | None = None) -> int:
        version = self.receiver.version + 1 if version is None else version
        # Collective: every rank receives the full weights (one all-gather per sharded tensor).
        sender.publish_weights(
            InProcessTransport(self.receiver), version, dtype=self.dtype, checksums=None, src_rank=None
        )
        return version


class DirectPublisher:
    """Through the engine's own ``publish`` (`PublishesDirectly`)."""

    def __init__(self, engine: PublishesDirectly, dtype: str) -> None:
        self.engine, self.dtype = engine, dtype

    def publish(self, sender: WeightSender, version: int | None = None) -> int:
        return self.engine.publish(sender, self.dtype, version)


def choose_publisher(
    engine: object,
    *,
    dtype: str,
    weights_root: str | os.PathLike[str] | None,
    in_process: WeightReceiver | None = None,
    keep_last: int = 2,
) -> WeightPublisher:
    """THE choice of how weights reach ``engine``: its own ``publish`` when it publishes directly, else straight
    into ``in_process`` (the receiver of an engine in the trainer's processes, when the caller allows memory
    publishing), else disk versions under ``weights_root``."""
    if isinstance(engine, PublishesDirectly) and engine.publishes_directly:
        return DirectPublisher(engine, dtype)
    if in_process is not None:
        return InProcessPublisher(in_process, dtype)
    if weights_root is None:
        raise ValueError(
            f"{type(engine).__name__} follows weight-sync disk versions, but no weights_root was given: pass the "
            "directory the trainer publishes to"
        )
    return DiskPublisher(weights_root, dtype, keep_last=keep_last)
