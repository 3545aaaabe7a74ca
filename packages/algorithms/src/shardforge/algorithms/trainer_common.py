"""Small pieces every trainer (SFT, reward model, GRPO, PPO) shares."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.engine.config import EngineConfig
from shardforge.weight_sync import DiskTransport

if TYPE_CHECKING:
    from shardforge.algorithms.rollout.factory import PublishedRolloutEngine

__all__ = ["check_eval_split", "progress_bar", "publish_to_rollout", "publish_version", "with_total_steps"]


def with_total_steps(engine: EngineConfig, steps: int) -> EngineConfig:
    """A decaying schedule left at total_steps <= 1 decays over the run's ``steps``."""
    if engine.scheduler.kind != "constant" and engine.scheduler.total_steps <= 1:
        return dataclasses.replace(engine, scheduler=dataclasses.replace(engine.scheduler, total_steps=steps))
    return engine


def progress_bar(total: int, initial: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar on the main rank (None elsewhere or when disabled)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, mininterval=2.0)


def publish_version(
    engine: TrainEngine,
    transport: DiskTransport | None,
    rollout: PublishedRolloutEngine,
    dtype: str,
    version: int | None = None,
) -> int:
    """Publish ``engine``'s weights as weight-sync version ``version`` (collective) and return it;
    when this returns, the version is committed on disk for every rank. ``version=None`` (a run's
    first publish) continues after any version already on disk, agreed from rank 0."""
    if version is None:
        latest = torch.tensor([float(rollout.source.latest() or 0) if rollout.source else 0.0])
        if dist.is_initialized():
            dist.broadcast(latest, src=0)
        version = int(latest[0]) + 1
    engine.publish_weights(transport, version, dtype=dtype)
    if dist.is_initialized():
        dist.barrier()
    return version


def publish_to_rollout(
    engine: TrainEngine,
    transport: DiskTransport | None,
    rollout: PublishedRolloutEngine,
    dtype: str,
    version: int | None = None,
) -> int:
    """Publish ``engine``'s weights as a new version and switch every rank's rollout engine to it;
    return the next version number (``version=None``: see `publish_version`)."""
    version = publish_version(engine, transport, rollout, dtype, version)
    rollout.update_weights(version)
    return version + 1


def check_eval_split(config: Any, num_held_out: int | None, dp_size: int) -> None:
    """With one vLLM on rank 0 (``vllm.placement=rank0``) every data-parallel rank must join each
    ``generate``; a rank left without held-out prompts would skip it and the others would wait until
    the process-group timeout. Refuse that split before training starts."""
    if num_held_out is None or dp_size <= 1 or config.rollout_engine != "vllm" or config.vllm.placement != "rank0":
        return
    count = num_held_out if config.eval_size is None else min(config.eval_size, num_held_out)
    if count < dp_size:
        raise ValueError(
            f"held-out evaluation has {count} prompts for {dp_size} data-parallel ranks; with "
            f"vllm.placement=rank0 every rank needs at least one: raise eval_size (or the eval file) to >= {dp_size}, "
            "or use vllm.placement=each_rank"
        )
