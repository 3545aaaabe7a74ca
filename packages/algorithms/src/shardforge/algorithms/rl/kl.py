"""Per-token KL estimators between the sampled policy and a reference policy.

Schulman, "Approximating KL Divergence" (2020): with samples x ~ pi and log-ratio
``log r = log pi_ref(x) - log pi(x)``, three unbiased-or-low-variance estimators of
KL(pi || pi_ref) are

- ``k1 = -log r``: unbiased, high variance, can be negative per token;
- ``k2 = (log r)^2 / 2``: biased, low variance, always >= 0 (its gradient is that of the
  true KL to first order, which is why GRPO-style KL *losses* like it);
- ``k3 = (r - 1) - log r``: unbiased, low variance, always >= 0 (DeepSeekMath's GRPO uses it).

As losses, gradients flow through ``logprobs`` only; ``ref_logprobs`` is data.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

__all__ = ["KLEstimator", "kl_estimate"]

KLEstimator = Literal["k1", "k2", "k3"]
"""Which estimator `kl_estimate` uses."""


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of the sampled tokens (same shape as inputs).

    Positions outside the loss mask are the caller's to ignore (multiply by the mask, or
    zero both inputs there); the estimate is finite wherever both inputs are finite.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape"
        )
    log_r = ref_logprobs.detach() - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        # expm1 keeps (r - 1) accurate when r is close to 1, where most tokens are.
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {list(get_args(KLEstimator))}")
