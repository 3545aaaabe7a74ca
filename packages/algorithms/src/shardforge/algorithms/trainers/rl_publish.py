"""Publishing the trainer's weights to a rollout engine in the same process, without disk.

The embedded HF rollout engine (`rollout.hf_engine.HFRolloutEngine`) lives in each trainer
process: a weight-sync version written to ``output_dir/weights`` and read back by the same
processes is a disk round trip for nothing. `in_process_receiver` says when the trainer can
instead hand the new weights to the engine's `WeightReceiver` through weight-sync's
`InProcessTransport` (same manifest and version checks, LoRA merged, cast to the rollout dtype;
no checksums: nothing crosses a process boundary). With several ranks every rank's engine needs
the full weights: `publish_in_process` all-gathers them to every rank (weight-sync's
``src_rank=None``; the disk path gathers to rank 0, writes, and every rank reads the files back). Asynchronous rollouts keep the disk path (the generator thread owns the engine and
may still need an older version).
"""

from __future__ import annotations

from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.rollout.hf_engine import HFRolloutEngine
from shardforge.weight_sync import InProcessTransport, WeightReceiver

__all__ = ["in_process_receiver", "publish_in_process"]


def in_process_receiver(rollout: object, *, enabled: bool, asynchronous: bool) -> WeightReceiver | None:
    """The receiver of ``rollout`` when the trainer may publish to it in memory (see the module), else None."""
    if not enabled or asynchronous or not isinstance(rollout, HFRolloutEngine):
        return None
    return rollout.receiver


def publish_in_process(engine: TrainEngine, receiver: WeightReceiver, dtype: str, version: int | None) -> int:
    """Publish ``engine``'s weights straight into ``receiver`` as ``version`` (None: the one after the
    version it serves); return the version. The engine serves it when this returns."""
    version = receiver.version + 1 if version is None else version
    # Collective: every rank receives the full weights (one all-gather per sharded tensor).
    engine.publish_weights(InProcessTransport(receiver), version, dtype=dtype, checksums=None, src_rank=None)
    return version
