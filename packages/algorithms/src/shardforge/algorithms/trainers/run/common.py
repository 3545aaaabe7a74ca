"""Small pieces every trainer shares (the loop itself is `shardforge.algorithms.trainers.base`;
what only the RL trainers share is in `rl_common`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from shardforge.engine.config import EngineConfig

if TYPE_CHECKING:  # imported where built: the launching process reads trainer configs without the engine
    from shardforge.engine import TrainEngine

__all__ = ["SourceSetState", "build_reference", "check_max_positions", "progress_bar", "with_total_steps"]


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


def check_max_positions(hf_config: Any, lengths: list[int], what: str, fix: str) -> None:
    """Refuse sequences longer than the model's ``max_position_embeddings`` (they would train on
    positions the model was never given, silently). ``what`` names the sequences, ``fix`` the remedy."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if not isinstance(limit, int) or not lengths:
        return
    longer = [n for n in lengths if n > limit]
    if longer:
        raise ValueError(
            f"{len(longer)} of {len(lengths)} {what} are longer than the model's max_position_embeddings={limit} "
            f"(longest: {max(longer)} tokens); {fix}"
        )


class SourceSetState:
    """The data-state hooks of a trainer whose batches come from ``self.data`` (a `data.source_set.SourceSet`):
    the resume point's fingerprint, each source's position in the checkpoint, and restoring it."""

    config: Any
    data: Any

    def data_state(self) -> dict[str, Any]:
        config = self.config
        state: dict[str, Any] = {"seed": config.seed, "global_batch_size": config.global_batch_size}
        return state | self.data.data_state()

    def extra_state(self) -> dict[str, Any]:
        return dict(self.data.extra_state())

    def setup(self, start: int, restored: dict[str, Any]) -> None:
        self.data.restore(restored)


def build_reference(config: Any, needed: bool) -> TrainEngine | None:
    """The frozen reference policy (``config.reference_model`` or ``config.model``) on ``config.layout`` when
    ``needed``, else None; offloaded between forwards with ``config.offload_reference``, scoring at the
    rollout temperature when the config has one (RL) as the policy does."""
    if not needed:
        return None
    ref_config = config.engine
    if config.offload_reference:  # on the device only for its forward (cpu_offload would keep it on host)
        ref_config = dataclasses.replace(ref_config, offload_when_idle=True, cpu_offload=False)
    from shardforge.engine import TrainEngine

    reference = TrainEngine(config.reference_model or config.model, config.layout, ref_config)
    temperature = getattr(config, "temperature", 0.0)
    if temperature > 0:
        reference.logprob_temperature = temperature
    return reference
