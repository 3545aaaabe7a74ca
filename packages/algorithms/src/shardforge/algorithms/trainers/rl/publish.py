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

``rollout_placement=disaggregated`` (`rollout.placement`): the engine is a `RayRolloutClient` of rollout actors,
and `direct_publisher` sends the weights to them over weight-sync's collective transport instead; with
``rollout_engine=vllm`` it is a `RayVLLMServerEngine` on the launcher's vLLM server actor, which receives them
over the collective transport too (``vllm.weight_transport: auto | collective``; ``disk``: it follows the disk
versions as a colocated server does). A colocated vLLM server with ``vllm.weight_transport: collective`` is
published to the same way. Such engines say so with ``direct_publish = True`` and have
``publish(engine, dtype, version)``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from shardforge.rollout.factory import PublishedRolloutEngine, build_rollout_engine
from shardforge.rollout.hf.engine import HFRolloutEngine
from shardforge.rollout.ray.hf_actor import RayRolloutClient
from shardforge.rollout.ray.placement import rollout_actor_names_from_env, rollout_actor_spec
from shardforge.weight_sync import InProcessTransport, WeightReceiver

if TYPE_CHECKING:  # the launching process imports this module for the config; only ranks build engines
    from shardforge.engine import TrainEngine

__all__ = ["build_placed_rollout", "direct_publisher", "in_process_receiver", "publish_in_process"]


def build_placed_rollout(config: Any, tokenizer: Any, weights_root: str | os.PathLike[str]) -> PublishedRolloutEngine:
    """The rollout engine of an RL trainer ``config``: ``rollout_engine`` in this process (colocated), or a client
    of the Ray launcher's rollout actors (``rollout_placement=disaggregated``)."""
    if config.rollout_placement == "disaggregated":
        names = rollout_actor_names_from_env(config.num_rollout_actors)  # refuses a rank not started by Ray
        world = dist.get_world_size() if dist.is_initialized() else 1
        spec = rollout_actor_spec(config, "ray", world)  # the other refusals, also under an outside launcher
        if spec is not None and spec.engine == "vllm":
            from shardforge.rollout.ray.vllm_server import RayVLLMServerEngine

            return RayVLLMServerEngine(
                names[0], config.model, tokenizer, options=config.vllm, weights_root=weights_root,
                dtype=config.rollout_dtype, seed=config.seed,
            )  # fmt: skip
        return RayRolloutClient(
            names, timeout_s=config.engine.dist_timeout_s, on_actor_failure=config.rollout_on_actor_failure
        )
    vllm = config.vllm
    if config.rollout_sleep and config.rollout_engine == "vllm":  # vLLM allocates differently with sleep mode
        vllm = dataclasses.replace(vllm, enable_sleep_mode=True)
    return build_rollout_engine(
        config.rollout_engine, config.model, tokenizer, weights_root=weights_root,
        dtype=config.rollout_dtype, vllm=vllm, seed=config.seed,
    )  # fmt: skip


def direct_publisher(
    engine: TrainEngine, rollout: object, receiver: WeightReceiver | None, dtype: str
) -> Callable[[int | None], int] | None:
    """``publish(version) -> version`` without the disk (None: publish through disk): into ``receiver`` (see
    `in_process_receiver`), or through the rollout engine's own ``publish`` (the rollout actors of a
    `RayRolloutClient`, a vLLM server over the collective transport). The rollout engine serves the version when
    ``publish`` returns; ``version=None``: the one after the served version."""
    if receiver is not None:  # same process: no disk round trip
        return partial(publish_in_process, engine, receiver, dtype)
    if getattr(rollout, "direct_publish", False):
        return partial(getattr(rollout, "publish"), engine, dtype)  # noqa: B009  (direct_publish says it has one)
    return None


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
