"""Configuration for `apply_fsdp` and activation checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["ActivationCheckpointConfig", "FSDPConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPConfig:
    """How `apply_fsdp` shards a model with FSDP2 (`fully_shard`)."""

    param_dtype: torch.dtype | None = None
    """Dtype parameters are all-gathered and computed in (None = keep the stored dtype)."""
    reduce_dtype: torch.dtype | None = torch.float32
    """Dtype gradients are reduce-scattered in (None = param_dtype)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2 like)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on CPU (FSDP2 CPUOffloadPolicy)."""
    wrap_classes: tuple[str, ...] | None = None
    """Class names wrapped as their own FSDP unit; None = the model's `_no_split_modules`."""
    keep_input_dtype_classes: tuple[str, ...] = ()
    """Class names (among the wrapped ones) whose units do not cast their floating-point forward inputs to
    ``param_dtype`` (FSDP2 ``cast_forward_inputs=False``): e.g. a vision tower's blocks, whose fp32 rotary
    cos/sin would otherwise be rounded to bf16 before the blocks upcast them again."""
    wrap_embeddings: bool = True
    """Wrap the input embedding as its own unit (skipped, with a warning, when tied to lm_head)."""
    wrap_lm_head: bool = True
    """Wrap the output projection as its own unit (skipped, with a warning, when tied)."""
    layers_per_unit: int = 1
    """Consecutive decoder layers per FSDP unit (one all-gather / reduce-scatter each): more layers per unit
    means fewer, larger collectives (less per-collective latency, more memory held gathered)."""
    forward_prefetch: int = 0
    """Units whose all-gather is issued ahead in forward (and, mirrored, in backward), on top of FSDP2's own
    one-unit backward prefetch: overlaps the next units' communication with this unit's compute."""

    def __post_init__(self) -> None:
        if self.layers_per_unit < 1 or self.forward_prefetch < 0:
            raise ValueError(
                f"layers_per_unit={self.layers_per_unit} must be >= 1 and forward_prefetch={self.forward_prefetch} >= 0"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointConfig:
    """Which decoder layers recompute their activations in backward."""

    mode: Literal["none", "full", "selective"] = "none"
    """none: keep all activations; full: every layer; selective: every `every`-th layer."""
    every: int = 2
    """For mode=selective: checkpoint layers 0, every, 2*every, ..."""
    layer_classes: tuple[str, ...] | None = None
    """Class names to checkpoint; None = the model's `_no_split_modules`."""
