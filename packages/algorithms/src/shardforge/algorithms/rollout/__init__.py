"""Rollout engines: a protocol, the embedded HF ``generate`` engine, the optional vLLM engine,
a factory that picks one by name, and reward functions."""

from shardforge.algorithms.rollout.factory import (
    ROLLOUT_ENGINES,
    PublishedRolloutEngine,
    RolloutEngineKind,
    build_rollout_engine,
)
from shardforge.algorithms.rollout.hf_engine import HFRolloutEngine
from shardforge.algorithms.rollout.reward_functions import RewardFn, exact_match_reward, load_reward_fn, score_rollouts
from shardforge.algorithms.rollout.types import Rollout, RolloutEngine, SamplingParams
from shardforge.algorithms.rollout.vllm_engine import VLLMOptions, VLLMRolloutEngine

__all__ = [
    "ROLLOUT_ENGINES",
    "HFRolloutEngine",
    "PublishedRolloutEngine",
    "RewardFn",
    "Rollout",
    "RolloutEngine",
    "RolloutEngineKind",
    "SamplingParams",
    "VLLMOptions",
    "VLLMRolloutEngine",
    "build_rollout_engine",
    "exact_match_reward",
    "load_reward_fn",
    "score_rollouts",
]
