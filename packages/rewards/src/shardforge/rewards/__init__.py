"""shardforge.rewards: reward / verifier functions and their registry, with no torch.

A reward function is ``fn(prompt: str, response: str, reference: str) -> float``. Built-ins are registered by
name in `REWARD_FUNCTIONS` (``exact_match``, ``math_verify``, ``math_verify_strict``, ``boxed_format``,
``think_format``, ``http_judge``, ``zero``); a user's is registered with ``@REWARD_FUNCTIONS.register("name")``
or named by import path. `build_reward` composes weighted terms, `GuardedReward` scores a batch concurrently
under a timeout and error policy, `score_outcomes` scores a batch with per-item outcomes, and
`shardforge.rewards.ray_pool` (extra ``[ray]``) spreads scoring over Ray actors.

Usable in any RL loop (or a reward server, or a data filter) without torch installed.
"""

from shardforge.rewards.batch import RewardItem, score_outcomes
from shardforge.rewards.compose import CompositeReward, RewardTermConfig, build_reward, make_reward
from shardforge.rewards.functions import REWARD_FUNCTIONS, RewardFn, exact_match_reward, load_reward_fn
from shardforge.rewards.guarded import GuardedReward, RewardConfig, RewardError

__version__ = "0.1.0"

__all__ = [
    "REWARD_FUNCTIONS",
    "CompositeReward",
    "GuardedReward",
    "RewardConfig",
    "RewardError",
    "RewardFn",
    "RewardItem",
    "RewardTermConfig",
    "build_reward",
    "exact_match_reward",
    "load_reward_fn",
    "make_reward",
    "score_outcomes",
]
