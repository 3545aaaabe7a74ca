"""Reward shaping (overlong penalty, scale, clip) and placing sequence rewards on tokens.

Legend: T = packed tokens, N = sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardforge.engine.batching import check_cu_seqlens, check_finite, check_tokens, last_target_index

__all__ = ["RewardShapingConfig", "overlong_penalty", "shape_rewards", "token_rewards"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardShapingConfig:
    """Options of `shape_rewards`, applied in this order: overlong penalty, scale, clip."""

    overlong_max_length: int | None = None
    """DAPO's L_max (the generation budget in tokens); None disables the overlong penalty."""
    overlong_cache_length: int = 0
    """DAPO's L_cache: the penalty ramps from 0 to -1 over the last L_cache tokens before L_max."""
    overlong_factor: float = 1.0
    """Multiplier of the overlong penalty (DAPO: 1)."""
    scale: float = 1.0
    """Multiply rewards by this."""
    clip: float | None = None
    """Clip rewards to [-clip, clip] (> 0); None: no clipping."""

    def __post_init__(self) -> None:
        if self.overlong_max_length is not None:
            if self.overlong_max_length < 1:
                raise ValueError(f"overlong_max_length must be >= 1; got {self.overlong_max_length}")
            if not 0 <= self.overlong_cache_length <= self.overlong_max_length:
                raise ValueError(
                    f"overlong_cache_length must be in [0, overlong_max_length={self.overlong_max_length}]; "
                    f"got {self.overlong_cache_length}"
                )
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0, or None; got {self.clip}")


def overlong_penalty(response_lengths: torch.Tensor, *, max_length: int, cache_length: int) -> torch.Tensor:
    """[N] DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of each response length |y|.

    ``0`` if ``|y| <= L_max - L_cache``; ``(L_max - L_cache - |y|) / L_cache`` in between
    (from 0 down to -1); ``-1`` if ``|y| > L_max``. With ``L_cache = 0`` it is a hard -1
    above ``L_max``.
    """
    if not 0 <= cache_length <= max_length:
        raise ValueError(f"need 0 <= cache_length <= max_length; got cache_length={cache_length}, max={max_length}")
    lengths = response_lengths.double()
    if bool((lengths < 0).any()):
        raise ValueError("response lengths must be >= 0")
    free = max_length - cache_length
    ramp = (free - lengths) / cache_length if cache_length > 0 else torch.zeros_like(lengths)
    penalty = torch.where(lengths <= free, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_length, torch.full_like(lengths, -1.0), penalty).float()


def shape_rewards(
    rewards: torch.Tensor,
    config: RewardShapingConfig,
    *,
    response_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N] shaped rewards: ``clip(scale * (r + factor * overlong_penalty(|y|)))``.

    Raises `ValueError` for non-finite rewards (a reward function returning NaN/inf must be
    fixed, not trained on) or when the overlong penalty is on but ``response_lengths`` is missing.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N] (one per sequence), got shape {tuple(rewards.shape)}")
    check_finite("rewards", rewards)
    out = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if config.overlong_max_length is not None:
        if response_lengths is None or tuple(response_lengths.shape) != tuple(rewards.shape):
            raise ValueError(
                "the overlong penalty needs response_lengths with one length per reward "
                f"(shape {tuple(rewards.shape)}); got "
                f"{None if response_lengths is None else tuple(response_lengths.shape)}"
            )
        penalty = overlong_penalty(
            response_lengths, max_length=config.overlong_max_length, cache_length=config.overlong_cache_length
        )
        out = out + config.overlong_factor * penalty.to(out.dtype)
    out = out * config.scale
    if config.clip is not None:
        out = out.clamp(-config.clip, config.clip)
    return out


def token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T]: each sequence's reward on its last target token, 0 elsewhere.

    A sequence without target tokens has no action to credit, so its reward is dropped.
    """
    num_tokens = loss_mask.numel()
    check_cu_seqlens(cu_seqlens, num_tokens)
    check_tokens("loss_mask", loss_mask, num_tokens)
    num_seqs = cu_seqlens.numel() - 1
    if tuple(rewards.shape) != (num_seqs,):
        raise ValueError(f"rewards must be [N] with N={num_seqs} sequences, got shape {tuple(rewards.shape)}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    out = torch.zeros(num_tokens, dtype=dtype, device=rewards.device)
    last = last_target_index(loss_mask, cu_seqlens)
    has = last >= 0
    out[last[has]] = rewards.to(dtype)[has]
    return out
