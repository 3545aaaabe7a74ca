"""Pick a rollout engine by name: ``"hf"`` (embedded ``generate``, default) or ``"vllm"``.

The trainers call `build_rollout_engine` with their ``rollout_engine`` and ``vllm`` config
fields. Both engines follow the same weight-sync disk root, so `publish_to_rollout` drives
either one.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Protocol

from shardforge.algorithms.rollout.hf_engine import HFRolloutEngine
from shardforge.algorithms.rollout.types import RolloutEngine
from shardforge.algorithms.rollout.vllm_engine import VLLMOptions, VLLMRolloutEngine, import_vllm
from shardforge.weight_sync import DiskWeightSource

__all__ = ["ROLLOUT_ENGINES", "PublishedRolloutEngine", "RolloutEngineKind", "build_rollout_engine"]

RolloutEngineKind = Literal["hf", "vllm"]
ROLLOUT_ENGINES: tuple[str, ...] = ("hf", "vllm")


class PublishedRolloutEngine(RolloutEngine, Protocol):
    """A `RolloutEngine` that reads the versions a trainer publishes under a disk root."""

    source: DiskWeightSource | None


def build_rollout_engine(
    kind: str,
    model_dir: str | os.PathLike[str],
    tokenizer: Any,
    *,
    weights_root: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
    vllm: VLLMOptions | None = None,
    seed: int = 0,
) -> PublishedRolloutEngine:
    """The rollout engine ``kind`` for ``model_dir``, following ``weights_root``.

    ``vllm`` options apply to ``kind="vllm"`` only; ``seed`` is vLLM's global seed (requests
    that carry their own seed do not use it). Raises ValueError for an unknown kind and
    ImportError (with the install command) when vLLM is asked for but not installed.
    """
    if kind not in ROLLOUT_ENGINES:
        raise ValueError(f"rollout_engine={kind!r} is not one of {list(ROLLOUT_ENGINES)}")
    if kind == "hf":
        return HFRolloutEngine(model_dir, tokenizer, weights_root=weights_root, dtype=dtype)
    options = vllm or VLLMOptions()
    if not isinstance(options, VLLMOptions):
        raise TypeError(f"vllm= must be VLLMOptions, got {type(options).__name__}")
    import_vllm()  # fail here, with the install command, before any model is loaded
    return VLLMRolloutEngine(model_dir, tokenizer, weights_root=weights_root, dtype=dtype, options=options, seed=seed)
