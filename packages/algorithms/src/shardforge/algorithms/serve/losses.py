"""The Tinker API's built-in losses, by name, over per-token log-probs of the datums' target tokens.

Tinker's losses are sums over tokens (not means): the client weighs tokens itself (``weights``,
``advantages``). The RL ones reuse our registered policy-gradient terms
(`shardforge.engine.objectives.POLICY_LOSSES`), so a Tinker loss means what the same name means in our
trainers:

    cross_entropy        l = -sum_t w_t log pi(x_t)                           inputs: target_tokens, weights (default 1)
    importance_sampling  l = sum_t reinforce_t = -sum_t (pi/q)_t A_t           inputs: target_tokens, logprobs (q), advantages
    ppo                  l = sum_t vanilla_t (PPO clip, eps = 1 - clip_low_threshold, clip_high_threshold - 1)
    cispo                l = sum_t cispo_t (the same clip thresholds)
    gspo                 l = sum_t gspo_t (PPO clip on each datum's geometric-mean ratio over its
                         ``sequence_ratio_mask`` tokens, default all; tokens outside the mask add nothing)
    dro                  l = -sum_t (log pi_t A_t - beta/2 (log pi_t - log q_t)^2)  (Tinker's docs; ``beta`` from
                         loss_fn_config, required: the hosted default is not documented)

Legend: T = the datums' tokens packed end to end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from shardforge.core.registry import Registry

__all__ = ["OPTIONAL_INPUTS", "SERVE_LOSSES", "LossResult", "ServeLossFn", "required_inputs"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossResult:
    loss: torch.Tensor
    """Scalar loss (a sum over tokens) to backpropagate."""
    elementwise: torch.Tensor
    """[T] the loss of each token (detached)."""


ServeLossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Sequence[int], Mapping[str, float]], LossResult]
"""``fn(logprobs_T, inputs, lengths, config) -> LossResult``: ``logprobs_T`` is differentiable, ``inputs`` maps
each loss input name to its [T] packed values, ``lengths`` are the datums' token counts."""

SERVE_LOSSES: Registry[ServeLossFn] = Registry("tinker loss")

_INPUTS = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}

OPTIONAL_INPUTS = {"cross_entropy": ("weights",), "gspo": ("sequence_ratio_mask",)}
"""Inputs a loss uses when every datum has them (cross_entropy's ``weights`` and gspo's ``sequence_ratio_mask``
default to 1)."""


def required_inputs(loss_fn: str) -> tuple[str, ...]:
    """The loss inputs ``loss_fn`` needs (``target_tokens`` and ``weights`` default for unknown names)."""
    return _INPUTS.get(loss_fn, ("target_tokens",))


@SERVE_LOSSES.register("cross_entropy")
def cross_entropy(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], lengths: Sequence[int], config: Mapping[str, float]
) -> LossResult:
    """Weighted negative log-likelihood, summed over tokens."""
    weights = inputs.get("weights")
    per_token = -logprobs if weights is None else -logprobs * weights.to(logprobs.dtype)
    return LossResult(loss=per_token.sum(), elementwise=per_token.detach())


def _policy_loss(name: str, eps_from_config: bool) -> ServeLossFn:
    def loss_fn(
        logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], lengths: Sequence[int], config: Mapping[str, float]
    ) -> LossResult:
        from shardforge.engine.objectives import POLICY_LOSSES, PPOActorConfig

        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        if eps_from_config and not 0 < low <= 1 <= high:
            raise ValueError(
                f"clip_low_threshold={low} and clip_high_threshold={high} must satisfy 0 < low <= 1 <= high"
            )
        actor = (
            PPOActorConfig(clip_eps_low=1.0 - low, clip_eps_high=high - 1.0) if eps_from_config else PPOActorConfig()
        )
        cu_seqlens = torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int32)
        old = inputs["logprobs"].to(logprobs.dtype)
        advantages = inputs["advantages"].to(logprobs.dtype)
        mask = inputs.get("sequence_ratio_mask")
        if mask is None:
            terms = POLICY_LOSSES.get(name)(logprobs, old, advantages, torch.ones_like(logprobs), cu_seqlens, actor)
            return LossResult(loss=terms.pg.sum(), elementwise=terms.pg.detach())
        on = mask != 0  # POLICY_LOSSES take off-mask values zeroed and leave their terms there to the caller
        zero = logprobs.new_zeros(())
        lp, old, advantages = (torch.where(on, x, zero) for x in (logprobs, old, advantages))
        terms = POLICY_LOSSES.get(name)(lp, old, advantages, on.to(logprobs.dtype), cu_seqlens, actor)
        pg = torch.where(on, terms.pg, zero)
        return LossResult(loss=pg.sum(), elementwise=pg.detach())

    loss_fn.__doc__ = f"Our registered {name!r} policy-gradient term, summed over tokens."
    return loss_fn


SERVE_LOSSES.add("importance_sampling", _policy_loss("reinforce", eps_from_config=False))
SERVE_LOSSES.add("ppo", _policy_loss("vanilla", eps_from_config=True))
SERVE_LOSSES.add("cispo", _policy_loss("cispo", eps_from_config=True))
SERVE_LOSSES.add("gspo", _policy_loss("gspo", eps_from_config=True))


@SERVE_LOSSES.register("dro")
def dro(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], lengths: Sequence[int], config: Mapping[str, float]
) -> LossResult:
    """DRO (Richemond et al. 2024) as Tinker documents it: the policy-gradient term with a quadratic penalty on the
    log-ratio to the sampler, summed over tokens."""
    if "beta" not in config:
        raise ValueError("loss 'dro' needs loss_fn_config={'beta': <float > 0>} (the weight of the quadratic penalty)")
    beta = config["beta"]
    if not beta > 0:
        raise ValueError(f"loss 'dro': loss_fn_config beta={beta} must be > 0")
    old = inputs["logprobs"].to(logprobs.dtype)
    advantages = inputs["advantages"].to(logprobs.dtype)
    per_token = -(logprobs * advantages - 0.5 * beta * (logprobs - old) ** 2)
    return LossResult(loss=per_token.sum(), elementwise=per_token.detach())
