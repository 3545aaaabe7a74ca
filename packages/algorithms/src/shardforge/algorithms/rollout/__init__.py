"""Rollout engines: a protocol, the embedded HF ``generate`` engine, and reward functions."""

from shardforge.algorithms.rollout.hf_engine import HFRolloutEngine
from shardforge.algorithms.rollout.reward_functions import RewardFn, exact_match_reward, load_reward_fn, score_rollouts
from shardforge.algorithms.rollout.types import Rollout, RolloutEngine, SamplingParams

__all__ = [
    "HFRolloutEngine",
    "RewardFn",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "exact_match_reward",
    "load_reward_fn",
    "score_rollouts",
]
