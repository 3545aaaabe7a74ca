"""KL coefficient controllers: fixed, or adaptive towards a target KL (verl's ``algorithm.kl_ctrl``).

Adaptive (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", sec. 2.2):
after a step that saw ``n`` samples with mean KL ``kl``,

    e     = clip(kl / target_kl - 1, -0.2, 0.2)
    beta *= 1 + e * n / horizon

so beta grows while the policy drifts beyond ``target_kl`` and shrinks while it stays inside.
Picked by ``type`` from `KL_CONTROLLERS` (verl's names ``fixed`` / ``adaptive``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shardforge.core.registry import Registry

__all__ = ["KL_CONTROLLERS", "AdaptiveKLController", "FixedKLController", "KLControlConfig", "build_kl_controller"]


@dataclass(frozen=True, kw_only=True, slots=True)
class KLControlConfig:
    """How the KL coefficient evolves (verl: ``algorithm.kl_ctrl``)."""

    type: str = "fixed"
    """"fixed" (constant kl_coef) or "adaptive" (towards target_kl), a name in `KL_CONTROLLERS`."""
    kl_coef: float = 0.0
    """The (initial) coefficient beta, >= 0."""
    target_kl: float = 0.1
    """adaptive: the KL per sample the controller steers towards (> 0)."""
    horizon: int = 10000
    """adaptive: samples over which a 20% error changes beta by 20% (> 0)."""

    def __post_init__(self) -> None:
        if self.type not in KL_CONTROLLERS:
            raise ValueError(f"unknown kl_ctrl type {self.type!r}; registered: {KL_CONTROLLERS.names()}")
        if self.kl_coef < 0 or self.target_kl <= 0 or self.horizon <= 0:
            raise ValueError(
                f"need kl_coef >= 0, target_kl > 0, horizon > 0; got {self.kl_coef}, {self.target_kl}, {self.horizon}"
            )


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, num_samples: int) -> None: ...


class FixedKLController:
    """beta stays at kl_coef."""

    def __init__(self, config: KLControlConfig) -> None:
        self.value = config.kl_coef

    def update(self, current_kl: float, num_samples: int) -> None:
        """Nothing changes."""


class AdaptiveKLController:
    """beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon (Ziegler et al. 2019)."""

    def __init__(self, config: KLControlConfig) -> None:
        self.value = config.kl_coef
        self.target = config.target_kl
        self.horizon = config.horizon

    def update(self, current_kl: float, num_samples: int) -> None:
        """Move beta after a step with mean KL ``current_kl`` over ``num_samples`` samples."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_samples / self.horizon


KL_CONTROLLERS: Registry[type] = Registry("KL controller")
KL_CONTROLLERS.add("fixed", FixedKLController)
KL_CONTROLLERS.add("adaptive", AdaptiveKLController)


def build_kl_controller(config: KLControlConfig) -> KLController:
    """The controller named by ``config.type``."""
    controller: KLController = KL_CONTROLLERS.get(config.type)(config)
    return controller
