"""shardforge.engine.objectives: the training objectives as pure functions of packed tensors.

SFT (`objectives.sft`), RL losses, advantages, KL estimators, loss aggregation, reward shaping,
rollout correction (trainer vs engine importance weights) and the Bradley-Terry reward-model loss. Imports only `shardforge.engine.batching` and
`shardforge.core.registry`.

See docs/packages/algorithms-rl.md for the formulas, options and the aggregation contract.
"""

from shardforge.engine.batching import broadcast_to_tokens, last_target_index, target_counts
from shardforge.engine.objectives import policy_losses as policy_losses  # registers CISPO, GMPO, SAPO, ...
from shardforge.engine.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    GroupAdvantageFn,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    group_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_outcome_advantages,
    reinforce_pp_outcome_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    whiten,
)
from shardforge.engine.objectives.aggregation import (
    AGGREGATIONS,
    Aggregation,
    LossAggregation,
    aggregation_coefficients,
    aggregation_weight,
)
from shardforge.engine.objectives.bradley_terry import bradley_terry_loss, last_token_scores
from shardforge.engine.objectives.critic import PPOCriticConfig, ppo_critic_loss
from shardforge.engine.objectives.kl import KL_ESTIMATORS, KLEstimator, kl_estimate
from shardforge.engine.objectives.kl_control import KL_CONTROLLERS, KLControlConfig, build_kl_controller
from shardforge.engine.objectives.loss_fns import PPOActorLossFn, PPOCriticLossFn
from shardforge.engine.objectives.policy_loss_options import ClipCovConfig, KLCovConfig, SAPOConfig
from shardforge.engine.objectives.ppo import (
    POLICY_LOSSES,
    PolicyLossFn,
    PolicyLossTerms,
    PPOActorConfig,
    ppo_actor_loss,
)
from shardforge.engine.objectives.preference import (
    PREFERENCE_LOSSES,
    PreferenceLossConfig,
    preference_loss,
    sequence_logprobs,
)
from shardforge.engine.objectives.rewards import RewardShapingConfig, overlong_penalty, shape_rewards, token_rewards
from shardforge.engine.objectives.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    RolloutCorrectionConfig,
    apply_rollout_correction,
    rollout_correction,
    summarize_correction_stats,
)
from shardforge.engine.objectives.stats import LossOutput, all_reduce_stats, merge_stats, summarize_stats

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "AdvantageEstimator",
    "Aggregation",
    "ClipCovConfig",
    "GroupAdvantageFn",
    "KLControlConfig",
    "KLCovConfig",
    "KLEstimator",
    "LossAggregation",
    "LossOutput",
    "PPOActorConfig",
    "PPOActorLossFn",
    "PPOCriticConfig",
    "PPOCriticLossFn",
    "PolicyLossFn",
    "PolicyLossTerms",
    "PreferenceLossConfig",
    "RewardShapingConfig",
    "RolloutCorrectionConfig",
    "SAPOConfig",
    "aggregation_coefficients",
    "aggregation_weight",
    "all_reduce_stats",
    "apply_rollout_correction",
    "bradley_terry_loss",
    "broadcast_to_tokens",
    "build_kl_controller",
    "discounted_returns",
    "dr_grpo_advantages",
    "gae_advantages",
    "group_advantages",
    "grpo_advantages",
    "grpo_passk_advantages",
    "kl_estimate",
    "last_target_index",
    "last_token_scores",
    "merge_stats",
    "opo_advantages",
    "overlong_penalty",
    "ppo_actor_loss",
    "ppo_critic_loss",
    "preference_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_outcome_advantages",
    "reinforce_pp_outcome_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "rollout_correction",
    "sequence_logprobs",
    "shape_rewards",
    "summarize_correction_stats",
    "summarize_stats",
    "target_counts",
    "token_rewards",
    "whiten",
]
