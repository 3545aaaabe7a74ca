"""One PPO actor-critic update on a packed rollout batch (used by `shardforge.algorithms.trainers.ppo`).

    rewards [N] -> token rewards (on each response's last token) - kl_coef * KL(actor || reference)
    values [T]  <- critic (per-position values shifted to target alignment, `target_aligned_values`)
    GAE(gamma, lam) -> advantages (optionally whitened over the global batch), returns
    actor.train_batch(PPO clip loss) and critic.train_batch(value-clipped loss)

Everything that is a statistic of the batch (whitening, explained variance, KL) is reduced over
the data-parallel group, so the update does not depend on how the rollouts are split.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from shardforge.algorithms.trainers.rl.metrics import StepMetrics
from shardforge.algorithms.trainers.rl.step_stats import add_actor_stats, add_behaviour_gap, add_correction_stats
from shardforge.algorithms.trainers.run.profiling import phase
from shardforge.engine.batching import PackedBatch, target_aligned_values
from shardforge.engine.objectives import (
    KLEstimator,
    PPOActorLossFn,
    PPOCriticLossFn,
    gae_advantages,
    kl_estimate,
    summarize_stats,
    token_rewards,
)
from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS, OLD_VALUES, REF_LOGPROBS, RETURNS
from shardforge.engine.objectives.rollout_correction import (
    BEHAVIOUR_LOGPROBS,
    RolloutCorrectionConfig,
    behaviour_gap,
    correct_batch,
)
from shardforge.mesh.collectives import all_reduce_stats, all_reduce_sum

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    from shardforge.engine import TrainEngine

__all__ = ["ShiftedCriticLossFn", "correct_actor_batch", "dp_reduce_stats", "ppo_update", "prepare_ppo_batch"]


class ShiftedCriticLossFn(PPOCriticLossFn):
    """`PPOCriticLossFn` for a value-head engine: its per-position values are shifted so entry t is
    the value of the state before target token t (the alignment of ``old_values`` and ``returns``)."""

    def __call__(self, values: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        return super().__call__(target_aligned_values(values, mb.cu_seqlens), mb)


def dp_reduce_stats(stats: dict[str, torch.Tensor], engine: TrainEngine) -> dict[str, torch.Tensor]:
    """Loss statistics summed over ``engine``'s data-parallel ranks only (TP/CP ranks hold copies)."""
    return all_reduce_stats(stats, engine.dp_group, engine.device)


@torch.no_grad()
def prepare_ppo_batch(
    batch: PackedBatch,
    rewards: torch.Tensor,
    actor: TrainEngine,
    critic: TrainEngine,
    reference: TrainEngine | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k1",
    whiten_advantages: bool = True,
    recompute_logprobs: bool = True,
) -> dict[str, float]:
    """Fill ``batch.extras`` with old log-probs, old values, advantages and returns; return global stats
    (``kl_ref``: mean per-token KL to the reference; ``explained_variance`` of the returns by the
    old values; ``advantage_mean``/``_std`` before whitening; ``return_mean``, ``value_mean``)."""
    mask = batch.loss_mask != 0
    fmask = mask.to(torch.float32)
    if recompute_logprobs or OLD_LOGPROBS not in batch.extras:
        with phase("old_logprobs"):
            batch.extras[OLD_LOGPROBS] = actor.forward(batch) * fmask
    old_logprobs = batch.extras[OLD_LOGPROBS]
    with phase("values"):
        values = target_aligned_values(critic.forward(batch), batch.cu_seqlens) * fmask
    per_token = token_rewards(rewards.float(), batch.loss_mask, batch.cu_seqlens)
    kl = torch.zeros_like(per_token)
    if reference is not None:
        with phase("ref_logprobs"):
            ref_logprobs = reference.forward(batch) * fmask
        batch.extras[REF_LOGPROBS] = ref_logprobs
        kl = kl_estimate(old_logprobs, ref_logprobs, kl_estimator) * fmask
        per_token = per_token - kl_coef * kl
    advantages, returns = gae_advantages(per_token, values, batch.loss_mask, batch.cu_seqlens, gamma=gamma, lam=lam)
    residual = returns - values
    count, adv_sum, adv_sq, kl_sum, ret_sum, ret_sq, res_sum, res_sq, val_sum = all_reduce_sum(
        fmask.sum(),
        advantages.sum(),
        advantages.square().sum(),
        kl.sum(),
        returns.sum(),
        returns.square().sum(),
        residual.sum(),
        residual.square().sum(),
        values.sum(),
        group=actor.dp_group,
        device=actor.device,
    )
    if count <= 0:
        raise ValueError("the rollout batch has no response tokens on any rank (all responses empty?)")
    adv_mean = adv_sum / count
    adv_std = math.sqrt(max(adv_sq / count - adv_mean**2, 0.0))
    if whiten_advantages:
        # Global whitening (population std); an all-equal batch gives 0 rather than amplified rounding.
        scale = 1.0 / (adv_std + 1e-8) if adv_std > 1e-6 else 0.0
        advantages = (advantages - adv_mean) * scale * fmask
    batch.extras[ADVANTAGES] = advantages.float()
    batch.extras[OLD_VALUES] = values.float()
    batch.extras[RETURNS] = returns.float()
    ret_var = ret_sq / count - (ret_sum / count) ** 2
    res_var = res_sq / count - (res_sum / count) ** 2
    return {
        "kl_ref": kl_sum / count,
        "explained_variance": 1.0 - res_var / ret_var if ret_var > 1e-12 else 0.0,
        "advantage_mean": adv_mean,
        "advantage_std": adv_std,
        "return_mean": ret_sum / count,
        "value_mean": val_sum / count,
    }


def correct_actor_batch(
    batch: PackedBatch, config: RolloutCorrectionConfig, actor: TrainEngine, metrics: StepMetrics
) -> PackedBatch:
    """The actor's view of a prepared batch with rollout correction applied (``ROLLOUT_IS_WEIGHTS``,
    rejected tokens out of its loss mask); the ``rollout_corr/*`` and ``behaviour_kl`` statistics go to
    ``metrics``. The critic keeps ``batch``: a token rejected for the policy gradient (an engine/trainer
    mismatch) still has a valid value target."""
    actor_batch = dataclasses.replace(batch, extras=dict(batch.extras))
    add_behaviour_gap(metrics, behaviour_gap(batch.extras[OLD_LOGPROBS], batch.extras[BEHAVIOUR_LOGPROBS],
                                             batch.loss_mask))  # fmt: skip
    stats = correct_batch(actor_batch, config, old_key=OLD_LOGPROBS, group=actor.dp_group, device=actor.device)
    add_correction_stats(metrics, stats)
    return actor_batch


def ppo_update(
    batch: PackedBatch,
    actor: TrainEngine,
    critic: TrainEngine,
    actor_fn: PPOActorLossFn,
    critic_fn: ShiftedCriticLossFn,
    *,
    epochs: int = 1,
    actor_batch: PackedBatch | None = None,
    metrics: StepMetrics | None = None,
) -> dict[str, float]:
    """``epochs`` optimizer steps of each engine on a prepared batch (the first starts at ratio 1 and
    v = v_old, so clipping acts from the second on); return the last step's actor (``loss``,
    ``grad_norm``) and critic (``critic/loss``, ``critic/grad_norm``) results and the loss statistics
    (``actor/*``, ``critic/*``: clip fractions, approx KL, value loss, ...) over all epochs.
    ``actor_batch``: the actor's view of ``batch`` (`correct_actor_batch`); default ``batch``. With ``metrics`` the
    loss statistics go there (reduced with the step's others), else they are reduced here."""
    if epochs < 1:
        raise ValueError(f"epochs={epochs} must be >= 1")
    for _ in range(epochs):
        stats = actor.train_batch(actor_batch or batch, actor_fn, actor_fn.loss_weight)
        critic_step = critic.train_batch(batch, critic_fn, critic_fn.loss_weight)
    if metrics is not None:
        add_actor_stats(metrics, actor_fn.pop_stats(), "actor/")
        add_actor_stats(metrics, critic_fn.pop_stats(), "critic/")
    else:
        actor_stats = summarize_stats(dp_reduce_stats(actor_fn.pop_stats(), actor))
        stats |= {f"actor/{k}": v for k, v in actor_stats.items()}
        critic_stats = summarize_stats(dp_reduce_stats(critic_fn.pop_stats(), critic))
        stats |= {f"critic/{k}": v for k, v in critic_stats.items()}
    stats |= {
        "critic/loss": critic_step["loss"],
        "critic/grad_norm": critic_step["grad_norm"],
        "critic/step_time_s": critic_step["step_time_s"],
    }
    return stats
