"""Adapters from the RL losses to `TrainEngine.train_batch(batch, loss_fn, loss_weight_fn)`.

Per-token inputs travel in ``PackedBatch.extras`` under the key names below (target-aligned
[T] tensors), so micro-batching (`PackedBatch.select`) slices them with the tokens::

    actor = PPOActorLossFn(PPOActorConfig(clip_eps_high=0.28))
    stats = engine.train_batch(batch, actor, actor.loss_weight)
    stats |= summarize_stats(actor.pop_stats())   # clip_frac, approx_kl, ... (local to this rank)

The engine calls ``loss_fn`` on empty placeholder micro-batches (zero loss mask, no
extras) to keep FSDP collectives in step; the adapters return a zero loss for those.
"""

from __future__ import annotations

import torch

from shardforge.engine.batching import PackedBatch
from shardforge.engine.objectives.aggregation import aggregation_weight, fixed_loss_weight
from shardforge.engine.objectives.critic import PPOCriticConfig, ppo_critic_loss
from shardforge.engine.objectives.ppo import PPOActorConfig, ppo_actor_loss
from shardforge.engine.objectives.rollout_correction import ROLLOUT_IS_WEIGHTS
from shardforge.engine.objectives.stats import merge_stats

__all__ = [
    "ADVANTAGES",
    "OLD_LOGPROBS",
    "OLD_VALUES",
    "PROXIMAL_LOGPROBS",
    "REF_LOGPROBS",
    "RETURNS",
    "PPOActorLossFn",
    "PPOCriticLossFn",
]

OLD_LOGPROBS = "old_logprobs"
"""[T] behaviour log-probs (recorded by the rollout engine)."""
PROXIMAL_LOGPROBS = "proximal_logprobs"
"""[T] optional proximal log-probs (decoupled PPO)."""
REF_LOGPROBS = "ref_logprobs"
"""[T] optional reference-model log-probs (KL loss term)."""
ADVANTAGES = "advantages"
"""[T] per-token advantages."""
OLD_VALUES = "old_values"
"""[T] critic values at rollout time."""
RETURNS = "returns"
"""[T] value targets."""


def _extra(mb: PackedBatch, key: str, *, required: bool) -> torch.Tensor | None:
    if key in mb.extras:
        return mb.extras[key]
    if required:
        raise KeyError(f"the micro-batch has no extra {key!r}; it has {sorted(mb.extras)} (add it to batch.extras)")
    return None


class _StatsSink:
    def __init__(self) -> None:
        self._stats: list[dict[str, torch.Tensor]] = []

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Merged stats of the micro-batches seen since the last call (this rank only), then reset."""
        merged = merge_stats(self._stats)
        self._stats = []
        return merged


class PPOActorLossFn(_StatsSink):
    """`ppo_actor_loss` as an engine ``loss_fn``; ``loss_weight`` is the matching ``loss_weight_fn``."""

    def __init__(self, config: PPOActorConfig | None = None) -> None:
        super().__init__()
        self.config = config or PPOActorConfig()

    wants_entropy = True
    """The engine passes the per-token entropy (for the bonus and the ``entropy`` statistic)."""

    def __call__(self, logprobs: torch.Tensor, mb: PackedBatch, entropy: torch.Tensor | None = None) -> torch.Tensor:
        if not bool((mb.loss_mask != 0).any()) and OLD_LOGPROBS not in mb.extras:
            return (logprobs * 0.0).sum()  # placeholder micro-batch
        out = ppo_actor_loss(
            logprobs,
            old_logprobs=_extra(mb, OLD_LOGPROBS, required=True),  # type: ignore[arg-type]
            advantages=_extra(mb, ADVANTAGES, required=True),  # type: ignore[arg-type]
            loss_mask=mb.loss_mask,
            cu_seqlens=mb.cu_seqlens,
            config=self.config,
            proximal_logprobs=_extra(mb, PROXIMAL_LOGPROBS, required=False),
            ref_logprobs=_extra(mb, REF_LOGPROBS, required=False),
            entropy=entropy,
            is_weights=_extra(mb, ROLLOUT_IS_WEIGHTS, required=False),
        )
        self._stats.append(out.stats)
        return out.loss_sum

    def loss_weight(self, mb: PackedBatch) -> torch.Tensor:
        return aggregation_weight(mb.loss_mask, mb.cu_seqlens, self.config.aggregation, self.config.norm_length)

    @property
    def fixed_loss_weight(self) -> float | None:
        """The global weight the engine divides by when the aggregation fixes it (``token-sum``: 1)."""
        return fixed_loss_weight(self.config.aggregation)


class PPOCriticLossFn(_StatsSink):
    """`ppo_critic_loss` as a loss function of (values [T], micro-batch), for a value-head engine."""

    def __init__(self, config: PPOCriticConfig | None = None) -> None:
        super().__init__()
        self.config = config or PPOCriticConfig()

    def __call__(self, values: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        if not bool((mb.loss_mask != 0).any()) and RETURNS not in mb.extras:
            return (values * 0.0).sum()
        out = ppo_critic_loss(
            values,
            old_values=_extra(mb, OLD_VALUES, required=True),  # type: ignore[arg-type]
            returns=_extra(mb, RETURNS, required=True),  # type: ignore[arg-type]
            loss_mask=mb.loss_mask,
            cu_seqlens=mb.cu_seqlens,
            config=self.config,
        )
        self._stats.append(out.stats)
        return out.loss_sum

    def loss_weight(self, mb: PackedBatch) -> torch.Tensor:
        return aggregation_weight(mb.loss_mask, mb.cu_seqlens, self.config.aggregation, self.config.norm_length)

    @property
    def fixed_loss_weight(self) -> float | None:
        """The global weight the engine divides by when the aggregation fixes it (``token-sum``: 1)."""
        return fixed_loss_weight(self.config.aggregation)
