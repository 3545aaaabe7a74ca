"""The policy-loss variants' own options: each a section of the actor config named after its loss
(``actor.clip_cov``, ``actor.kl_cov``, ``actor.sapo``), read only by that loss (`policy_losses`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClipCovConfig", "KLCovConfig", "SAPOConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClipCovConfig:
    """``policy_loss: clip_cov`` (Clip-Cov, Cui et al. 2025)."""

    ratio: float = 0.0002
    """Fraction of target tokens (high covariance) whose gradient is dropped."""
    lb: float = 1.0
    """Only tokens with covariance above this are candidates."""
    ub: float = 5.0
    """Only tokens with covariance below this are candidates."""

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"actor.clip_cov.ratio is a fraction of tokens in (0, 1] (papers: 2e-4); got {self.ratio}")
        if not self.lb < self.ub:
            raise ValueError(f"actor.clip_cov.lb={self.lb} must be < actor.clip_cov.ub={self.ub}")


@dataclass(frozen=True, kw_only=True, slots=True)
class KLCovConfig:
    """``policy_loss: kl_cov`` (KL-Cov, Cui et al. 2025)."""

    ratio: float = 0.0002
    """Fraction of target tokens (highest covariance) that get the |log ratio| penalty."""
    coef: float = 1.0
    """Coefficient of the |log pi - log prox| penalty on the selected tokens (verl's ``ppo_kl_coef``, whose
    config default is 0.1; set 0.1 to match verl)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"actor.kl_cov.ratio is a fraction of tokens in (0, 1] (papers: 2e-4); got {self.ratio}")
        if self.coef < 0:
            raise ValueError(f"actor.kl_cov.coef must be >= 0; got {self.coef}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SAPOConfig:
    """``policy_loss: sapo`` (soft adaptive gate, Gao et al. 2025)."""

    tau_pos: float = 1.0
    """Temperature of the soft gate for positive advantages."""
    tau_neg: float = 1.05
    """Temperature of the soft gate for negative advantages (larger: faster decay)."""

    def __post_init__(self) -> None:
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError(f"actor.sapo.tau_pos/neg must be > 0; got {self.tau_pos}, {self.tau_neg}")
