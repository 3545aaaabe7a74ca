"""Rollout engines: a protocol, the embedded HF ``generate`` engine, the optional vLLM engines,
a registry that picks one by name, and reward functions.

The engine classes are imported on first use (``rollout.HFRolloutEngine``), so importing this
package imports neither transformers' generation code nor ``vllm_engine.py`` / ``vllm_server.py``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardforge.algorithms.rollout.factory import (
    ROLLOUT_ENGINES,
    PublishedRolloutEngine,
    RolloutEngineKind,
    build_rollout_engine,
)
from shardforge.algorithms.rollout.reward_functions import (
    REWARD_FUNCTIONS,
    RewardFn,
    exact_match_reward,
    load_reward_fn,
    score_rollouts,
)
from shardforge.algorithms.rollout.types import Rollout, RolloutEngine, SamplingParams, SessionRolloutEngine

if TYPE_CHECKING:
    from shardforge.algorithms.rollout.hf_engine import HFRolloutEngine
    from shardforge.algorithms.rollout.vllm_engine import VLLMOptions, VLLMRolloutEngine
    from shardforge.algorithms.rollout.vllm_server import VLLMServerRolloutEngine

__all__ = [
    "REWARD_FUNCTIONS",
    "ROLLOUT_ENGINES",
    "HFRolloutEngine",
    "PublishedRolloutEngine",
    "RewardFn",
    "Rollout",
    "RolloutEngine",
    "RolloutEngineKind",
    "SamplingParams",
    "SessionRolloutEngine",
    "VLLMOptions",
    "VLLMRolloutEngine",
    "VLLMServerRolloutEngine",
    "build_rollout_engine",
    "exact_match_reward",
    "load_reward_fn",
    "score_rollouts",
]

_LAZY = {
    "HFRolloutEngine": "shardforge.algorithms.rollout.hf_engine",
    "VLLMOptions": "shardforge.algorithms.rollout.vllm_engine",
    "VLLMRolloutEngine": "shardforge.algorithms.rollout.vllm_engine",
    "VLLMServerRolloutEngine": "shardforge.algorithms.rollout.vllm_server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
