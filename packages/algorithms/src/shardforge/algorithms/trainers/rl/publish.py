"""An RL trainer's rollout engine and weight publisher, from its ``rollout:`` section.

`build_trainer_rollout` is the trainers' one call: it refuses a placement the run cannot have (the same refusals
the Ray launcher applies, also under an outside launcher) and hands the section to
`shardforge.rollout.build_rollout`, which builds the engine whole and picks how weights reach it (disk versions,
in-process, or the engine's own collective ``publish``; `shardforge.rollout.publish`). `publish_and_serve` is the
synchronous trainers' step end: publish the new weights, then serve them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from shardforge.rollout.factory import BuiltRollout, build_rollout
from shardforge.rollout.ray.placement import rollout_actor_spec

if TYPE_CHECKING:  # the launching process imports this module for the config; only ranks build engines
    from shardforge.engine import TrainEngine

__all__ = ["build_trainer_rollout", "publish_and_serve"]


def build_trainer_rollout(
    config: Any,
    tokenizer: Any,
    weights_root: str | os.PathLike[str],
    engine: TrainEngine,
    *,
    asynchronous: bool = False,
    keep_versions: int = 2,
) -> BuiltRollout:
    """The rollout of an RL trainer ``config`` (its ``rollout`` section, ``model``, ``seed``, ``engine.router_replay``)
    for the policy ``engine``. ``asynchronous``: a background thread drives the engine (disk versions only, of which
    ``keep_versions`` are kept)."""
    if config.rollout.placement == "disaggregated":
        world = dist.get_world_size() if dist.is_initialized() else 1
        rollout_actor_spec(config, "ray", world)  # the launcher's refusals, also under an outside launcher
    return build_rollout(
        config.rollout, config.model, tokenizer, weights_root=weights_root, seed=config.seed,
        record_routing=config.engine.router_replay, asynchronous=asynchronous, keep_versions=keep_versions,
        in_memory_allowed=engine.dims.pp == 1, actor_timeout_s=config.engine.dist_timeout_s,
    )  # fmt: skip


def publish_and_serve(rollout: BuiltRollout, engine: TrainEngine, version: int | None) -> int:
    """Publish ``engine``'s weights as ``version`` (None: the one after the newest) and switch every rank's rollout
    engine to it; return the version after it (collective)."""
    version = rollout.publisher.publish(engine, version)
    rollout.engine.update_weights(version)
    return version + 1
