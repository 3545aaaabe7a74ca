"""Per-token KL estimators between the sampled policy and a reference policy.

Schulman, "Approximating KL Divergence" (2020): with samples x ~ pi and log-ratio
``log r = log pi_ref(x) - log pi(x)``, three unbiased-or-low-variance estimators of
KL(pi || pi_ref) are

- ``k1 = -log r``: unbiased, high variance, can be negative per token;
- ``k2 = (log r)^2 / 2``: biased, low variance, always >= 0 (its gradient is that of the
  true KL to first order, which is why GRPO-style KL *losses* like it);
- ``k3 = (r - 1) - log r``: unbiased, low variance, always >= 0 (DeepSeekMath's GRPO uses it);
- ``abs = |log r|`` (verl's "abs").
- ``k1+`` / ``k3+``: straight-through, the *value* of k1 / k3 with the *gradient* of k2 (as
  verl's "k1+" / "k3+"): k2's gradient is the unbiased estimate of grad KL as a loss term.

Each is registered by name in `KL_ESTIMATORS` (verl's aliases: ``kl`` = k1, ``mse`` = k2).
verl 0.9.1 computes ``k3`` and ``low_var_kl`` in one branch and clamps both: ``log r`` to [-20, 20]
before the exponential and the estimate to [-10, 10]. Ours is not clamped (a token that far from the
reference gets its true penalty and gradient, where verl's clamp zeroes the gradient); the two agree
wherever ``k3 <= 10``. Wrap it in a registered estimator of your own to reproduce verl's clamp. Register your own with
``@KL_ESTIMATORS.register("name")`` on ``fn(log_r) -> estimate`` (``log_r = ref - pi``, per token),
or name it by import path ``"package.module:function"``.

As losses, gradients flow through ``logprobs`` only; ``ref_logprobs`` is data.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardforge.core.registry import Registry

__all__ = ["KL_ESTIMATORS", "KLEstimator", "check_kl_estimator", "kl_estimate"]

KLEstimator = str
"""The name of an estimator registered in `KL_ESTIMATORS` (or a ``"package.module:function"`` path)."""

KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator")
"""Per-token KL estimators ``fn(log_r) -> estimate`` with ``log_r = log pi_ref - log pi``."""


@KL_ESTIMATORS.register("k1")
def k1(log_r: torch.Tensor) -> torch.Tensor:
    """k1 = -log r: unbiased, high variance (verl: "kl", "k1")."""
    return -log_r


@KL_ESTIMATORS.register("k2")
def k2(log_r: torch.Tensor) -> torch.Tensor:
    """k2 = (log r)^2 / 2: biased, low variance, >= 0 (verl: "mse", "k2")."""
    return 0.5 * log_r.square()


@KL_ESTIMATORS.register("k3")
def k3(log_r: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r: unbiased, low variance, >= 0 (verl's "k3" / "low_var_kl" clamp it; see the module docstring)."""
    # expm1 keeps (r - 1) accurate when r is close to 1, where most tokens are.
    return torch.expm1(log_r) - log_r


@KL_ESTIMATORS.register("abs")
def abs_kl(log_r: torch.Tensor) -> torch.Tensor:
    """abs = |log r| (verl: "abs")."""
    return log_r.abs()


def _straight_through(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def estimate(log_r: torch.Tensor) -> torch.Tensor:
        # value of `forward`, gradient of k2: k2's gradient (log pi - log ref) grad log pi is the
        # unbiased estimate of grad KL(pi || ref), which k1's and k3's own gradients are not.
        backward = k2(log_r)
        return backward - backward.detach() + forward(log_r).detach()

    return estimate


KL_ESTIMATORS.add(
    "k1+", _straight_through(k1), doc="straight-through: value of k1, gradient of k2 (unbiased KL gradient; verl)"
)
KL_ESTIMATORS.add(
    "k3+", _straight_through(k3), doc="straight-through: value of k3, gradient of k2 (unbiased KL gradient; verl)"
)
KL_ESTIMATORS.add("kl", k1, doc="alias of k1 (verl's name)")
KL_ESTIMATORS.add("mse", k2, doc="alias of k2 (verl's name)")


def check_kl_estimator(name: str, field: str = "kl_estimator") -> None:
    """Raise `ValueError` naming the registered estimators when ``name`` is not one (nor an import path)."""
    if name in KL_ESTIMATORS:
        return
    try:
        KL_ESTIMATORS.get(name)
    except ValueError as err:
        raise ValueError(f"unknown {field} {name!r}; registered: {KL_ESTIMATORS.names()}") from err


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of the sampled tokens (same shape as inputs).

    Positions outside the loss mask are the caller's to ignore (multiply by the mask, or
    zero both inputs there); the estimate is finite wherever both inputs are finite.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape"
        )
    fn = KL_ESTIMATORS.get(estimator)
    return fn(ref_logprobs.detach() - logprobs)
