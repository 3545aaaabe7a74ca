"""shardforge.rollout: rollout engines behind one protocol, and the episodes that collect trajectories.

- `RolloutEngine` / `SessionRolloutEngine` (protocols), `Rollout`, `SamplingParams`, `PromptSet`, `ImageInputs`;
- engines by name in `ROLLOUT_ENGINES` (``hf``: embedded ``generate``; ``vllm``: in process or a server; a user's
  by import path), built whole by `build_rollout_engine`;
- `shardforge.rollout.workflows`: (engine, data row) -> token-in/token-out `Trajectory` s (``rlvr``,
  ``multi_turn``, ``tool_use``, a user's), batched through a `RequestQueue`.

The engine classes are imported on first use (``rollout.HFRolloutEngine``), so importing this package imports
neither transformers' generation code nor vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardforge.rollout.config import RolloutConfig, VLLMOptions
from shardforge.rollout.factory import (
    ROLLOUT_ENGINES,
    BuiltRollout,
    PublishedRolloutEngine,
    build_rollout,
    build_rollout_engine,
)
from shardforge.rollout.types import (
    ImageInputs,
    PromptSet,
    Rollout,
    RolloutEngine,
    SamplingParams,
    SessionRolloutEngine,
)

if TYPE_CHECKING:
    from shardforge.rollout.config import VLLMOptions
    from shardforge.rollout.hf.engine import HFRolloutEngine
    from shardforge.rollout.vllm.engine import VLLMRolloutEngine
    from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

__version__ = "0.1.0"

__all__ = [
    "ROLLOUT_ENGINES",
    "BuiltRollout",
    "HFRolloutEngine",
    "ImageInputs",
    "PromptSet",
    "PublishedRolloutEngine",
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingParams",
    "SessionRolloutEngine",
    "VLLMOptions",
    "VLLMRolloutEngine",
    "VLLMServerRolloutEngine",
    "build_rollout",
    "build_rollout_engine",
]

_LAZY = {
    "HFRolloutEngine": "shardforge.rollout.hf.engine",
    "VLLMRolloutEngine": "shardforge.rollout.vllm.engine",
    "VLLMServerRolloutEngine": "shardforge.rollout.vllm.server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
