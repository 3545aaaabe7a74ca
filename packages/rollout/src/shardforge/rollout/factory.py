"""Pick a rollout engine by name from `ROLLOUT_ENGINES`: ``"hf"`` (embedded ``generate``, default)
or ``"vllm"`` (in-process, or a server when ``vllm.mode="server"``).

The trainers call `build_rollout_engine` with their ``rollout_engine`` and ``vllm`` config
fields. Every engine follows the same weight-sync disk root, so `publish_to_rollout` drives
any of them. The vLLM builders are registered lazily (by import path), so importing this
module never imports ``vllm_engine.py`` / ``vllm_server.py``. A user's engine is one function
with `RolloutEngineBuilder`'s signature, registered with ``@ROLLOUT_ENGINES.register("name")``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, Protocol

from shardforge.core.registry import Registry
from shardforge.rollout.types import RolloutEngine
from shardforge.weight_sync import DiskWeightSource

if TYPE_CHECKING:
    from shardforge.rollout.vllm.engine import VLLMOptions

__all__ = [
    "ROLLOUT_ENGINES",
    "PublishedRolloutEngine",
    "RolloutEngineBuilder",
    "RolloutEngineKind",
    "build_rollout_engine",
]

RolloutEngineKind = Literal["hf", "vllm"]
"""The built-in engines a trainer config can name (config_io checks the value against it)."""


class PublishedRolloutEngine(RolloutEngine, Protocol):
    """A `RolloutEngine` that reads the versions a trainer publishes under a disk root."""

    source: DiskWeightSource | None


class RolloutEngineBuilder(Protocol):
    """``fn(model_dir, tokenizer, *, weights_root, dtype, vllm, seed) -> PublishedRolloutEngine``."""

    def __call__(
        self,
        model_dir: str | os.PathLike[str],
        tokenizer: Any,
        *,
        weights_root: str | os.PathLike[str] | None,
        dtype: str,
        vllm: VLLMOptions | None,
        seed: int,
    ) -> PublishedRolloutEngine: ...


ROLLOUT_ENGINES: Registry[RolloutEngineBuilder] = Registry("rollout engine")


@ROLLOUT_ENGINES.register("hf")
def build_hf_engine(
    model_dir: str | os.PathLike[str],
    tokenizer: Any,
    *,
    weights_root: str | os.PathLike[str] | None,
    dtype: str,
    vllm: VLLMOptions | None,
    seed: int,
) -> PublishedRolloutEngine:
    """embedded HF `generate` on the trainer's ranks (default)"""
    from shardforge.mesh import current_device
    from shardforge.rollout.hf.engine import HFRolloutEngine

    # On this rank's accelerator when there is one (HFRolloutEngine alone defaults to the CPU).
    device = current_device()
    return HFRolloutEngine(model_dir, tokenizer, weights_root=weights_root, dtype=dtype, device=device)


ROLLOUT_ENGINES.register_lazy(
    "vllm",
    "shardforge.rollout.vllm.builders:build_vllm_engine",
    "vLLM, in process (vllm.mode=in_process) or a server (vllm.mode=server)",
)


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
    """The rollout engine ``kind`` (a name in `ROLLOUT_ENGINES`) for ``model_dir``, following ``weights_root``.

    ``vllm`` options apply to ``kind="vllm"`` only (``vllm.mode`` picks `VLLMRolloutEngine` or
    `VLLMServerRolloutEngine`); ``seed`` is vLLM's global seed (requests
    that carry their own seed do not use it). Raises ValueError for an unknown kind and
    ImportError (with the install command) when vLLM is asked for but not installed.
    """
    if kind not in ROLLOUT_ENGINES and ":" not in kind:
        raise ValueError(f"rollout_engine={kind!r} is not one of {ROLLOUT_ENGINES.names()}")
    builder = ROLLOUT_ENGINES.get(kind)
    return builder(model_dir, tokenizer, weights_root=weights_root, dtype=dtype, vllm=vllm, seed=seed)
