"""Publishing the trainer's weights to a rollout engine in the same process, without disk.

At world size 1 the embedded HF rollout engine (`rollout.hf_engine.HFRolloutEngine`) lives in
the trainer's process: a weight-sync version written to ``output_dir/weights`` and read back
by the same process is a disk round trip for nothing. `in_process_receiver` says when the
trainer can instead hand the new weights to the engine's `WeightReceiver` through
weight-sync's `InProcessTransport` (same manifest and version checks, LoRA merged, cast to the
rollout dtype; no checksums: nothing crosses a process boundary). With several ranks every
rank's embedded engine needs the full weights, which the disk path (one writer, every rank
reads) provides; asynchronous rollouts keep the disk path too (the generator thread owns the
engine and may still need an older version).
"""

from __future__ import annotations

import torch.distributed as dist

from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.rollout.hf_engine import HFRolloutEngine
from shardforge.weight_sync import InProcessTransport, WeightReceiver

__all__ = ["in_process_receiver", "publish_in_process"]


def in_process_receiver(rollout: object, *, enabled: bool, asynchronous: bool) -> WeightReceiver | None:
    """The receiver of ``rollout`` when the trainer may publish to it in memory (see the module), else None."""
    if not enabled or asynchronous or not isinstance(rollout, HFRolloutEngine):
        return None
    if dist.is_initialized() and dist.get_world_size() > 1:
        return None
    return rollout.receiver


def publish_in_process(engine: TrainEngine, receiver: WeightReceiver, dtype: str, version: int | None) -> int:
    """Publish ``engine``'s weights straight into ``receiver`` as ``version`` (None: the one after the
    version it serves); return the version. The engine serves it when this returns."""
    version = receiver.version + 1 if version is None else version
    engine.publish_weights(InProcessTransport(receiver), version, dtype=dtype, checksums=None)
    return version
