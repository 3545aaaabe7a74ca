"""shardforge.algorithms.rl: RL losses, advantages and rewards as pure functions of packed tensors.

See docs/packages/algorithms-rl.md for the formulas, options and the aggregation contract.
"""

from shardforge.algorithms.batching import broadcast_to_tokens, last_target_index, target_counts
from shardforge.algorithms.rl.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    whiten,
)
from shardforge.algorithms.rl.aggregation import LossAggregation, aggregation_coefficients, aggregation_weight
from shardforge.algorithms.rl.critic import PPOCriticConfig, ppo_critic_loss
from shardforge.algorithms.rl.kl import KLEstimator, kl_estimate
from shardforge.algorithms.rl.loss_fns import PPOActorLossFn, PPOCriticLossFn
from shardforge.algorithms.rl.ppo import PPOActorConfig, ppo_actor_loss
from shardforge.algorithms.rl.reward_model import bradley_terry_loss, last_token_scores
from shardforge.algorithms.rl.rewards import RewardShapingConfig, overlong_penalty, shape_rewards, token_rewards
from shardforge.algorithms.rl.stats import LossOutput, all_reduce_stats, merge_stats, summarize_stats

__all__ = [
    "KLEstimator",
    "LossAggregation",
    "LossOutput",
    "PPOActorConfig",
    "PPOActorLossFn",
    "PPOCriticConfig",
    "PPOCriticLossFn",
    "RewardShapingConfig",
    "aggregation_coefficients",
    "aggregation_weight",
    "all_reduce_stats",
    "bradley_terry_loss",
    "broadcast_to_tokens",
    "discounted_returns",
    "dr_grpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "kl_estimate",
    "last_target_index",
    "last_token_scores",
    "merge_stats",
    "overlong_penalty",
    "ppo_actor_loss",
    "ppo_critic_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "shape_rewards",
    "summarize_stats",
    "target_counts",
    "token_rewards",
    "whiten",
]
