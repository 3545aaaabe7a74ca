"""Old log-probs from the training forward: skip the recompute pass when it is redundant.

With one optimizer update per rollout batch (GRPO; PPO with one epoch and one mini-batch), the
weights that would recompute the old log-probs are the weights of the training forward: the
old log-probs *are* the training forward's, detached. TRL (``num_iterations=1``) and verl (on
policy, one mini-batch) take them from there instead of running a separate no-grad forward;
the PPO ratio is then exactly 1 in value and its gradient is ``grad log pi``.

`OnPolicyActorLossFn` does that per micro-batch, and applies the rollout correction
(`objectives.rollout_correction`) with the detached log-probs as the trainer's side, so the
correction weights are the ones the recompute path would compute. Only corrections that keep
every token can run inside the loss: the engine fixes the loss normaliser (the loss weight of
every micro-batch) before the first forward, and ``batch_normalize`` needs the whole batch's
weights first. `reuse_is_exact` says when a configuration qualifies.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shardforge.engine.batching import PackedBatch
from shardforge.engine.objectives.loss_fns import OLD_LOGPROBS, PROXIMAL_LOGPROBS, PPOActorLossFn
from shardforge.engine.objectives.ppo import PPOActorConfig
from shardforge.engine.objectives.rollout_correction import (
    BEHAVIOUR_LOGPROBS,
    ROLLOUT_CORRECTIONS,
    ROLLOUT_IS_WEIGHTS,
    ISCorrection,
    RolloutCorrectionConfig,
    rollout_correction,
)
from shardforge.engine.objectives.stats import merge_stats

__all__ = ["OnPolicyActorLossFn", "correction_fits_in_loss", "has_dropout"]


def correction_fits_in_loss(config: RolloutCorrectionConfig | None) -> bool:
    """Whether the rollout correction ``config`` can be computed per micro-batch inside the loss:
    no correction, or a built-in mode that never drops a token (``none``, ``*_tis``) without
    ``batch_normalize``. Masking modes change the loss normaliser, which the engine fixes before
    the forward; a user's mode may mask, so it is not trusted here."""
    if config is None:
        return True
    mode = ROLLOUT_CORRECTIONS.get(config.mode)
    if not isinstance(mode, ISCorrection) or not mode.recompute:
        return False
    return mode.action in ("none", "truncate") and not config.batch_normalize


def has_dropout(hf_config: object) -> bool:
    """Whether an HF config turns on any dropout (``*dropout*`` attributes > 0): then the training
    forward (train mode) differs from a recompute (eval mode) and its log-probs are not the old ones."""
    values = getattr(hf_config, "to_dict", lambda: vars(hf_config))()
    return any(
        "dropout" in name and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        for name, v in values.items()
    )


class OnPolicyActorLossFn(PPOActorLossFn):
    """`PPOActorLossFn` whose old log-probs are the training forward's, detached (see the module).

    ``correction``: the rollout correction to apply per micro-batch against
    ``extras[BEHAVIOUR_LOGPROBS]`` (None: no correction); it must satisfy
    `correction_fits_in_loss`. `pop_correction_stats` returns the correction's statistics (sums,
    this rank only) and the behaviour gap ``|old - behav|`` as ``behaviour_gap`` / ``num_tokens``.
    """

    def __init__(self, config: PPOActorConfig | None = None, correction: RolloutCorrectionConfig | None = None) -> None:
        super().__init__(config)
        if not correction_fits_in_loss(correction):
            raise ValueError(
                f"rollout_correction {correction} cannot run inside the loss (it may drop tokens or needs the "
                "whole batch); recompute the old log-probs instead"
            )
        self.correction = correction
        self._correction_stats: list[dict[str, torch.Tensor]] = []

    def __call__(self, logprobs: torch.Tensor, mb: PackedBatch, entropy: torch.Tensor | None = None) -> torch.Tensor:
        if not bool((mb.loss_mask != 0).any()) and BEHAVIOUR_LOGPROBS not in mb.extras:
            return (logprobs * 0.0).sum()  # placeholder micro-batch
        if PROXIMAL_LOGPROBS in mb.extras:
            raise ValueError(
                f"the micro-batch has {PROXIMAL_LOGPROBS!r} (decoupled PPO on a stale batch): its old log-probs are "
                "not this forward's; use PPOActorLossFn with recomputed ones"
            )
        old = logprobs.detach()
        extras = dict(mb.extras)
        extras[OLD_LOGPROBS] = old  # replaces the rollout's copy of the behaviour log-probs, if any
        if self.correction is not None:
            behaviour = mb.extras[BEHAVIOUR_LOGPROBS].to(old.device)
            out = rollout_correction(old, behaviour, mb.loss_mask, mb.cu_seqlens, self.correction)
            if not torch.equal(out.loss_mask, mb.loss_mask):  # correction_fits_in_loss rules this out
                raise RuntimeError("the rollout correction dropped tokens inside the loss; this is a bug")
            extras[ROLLOUT_IS_WEIGHTS] = out.weights.to(old.device)
            mask = mb.loss_mask != 0
            gap = (old.double() - behaviour.double())[mask].abs().sum().cpu()
            self._correction_stats.append(out.stats | {"behaviour_gap": gap})
        return super().__call__(logprobs, replace(mb, extras=extras), entropy)

    def pop_correction_stats(self) -> dict[str, torch.Tensor]:
        """Merged rollout-correction sums of the micro-batches since the last call (this rank), then reset."""
        merged = merge_stats(self._correction_stats)
        self._correction_stats = []
        return merged
