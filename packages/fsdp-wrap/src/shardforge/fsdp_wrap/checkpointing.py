"""Activation checkpointing for decoder layers without renaming parameters."""

from __future__ import annotations

from torch import nn

from shardforge.fsdp_wrap.config import ActivationCheckpointConfig
from shardforge.fsdp_wrap.policy import find_layer_modules, resolve_layer_classes

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: nn.Module, config: ActivationCheckpointConfig) -> int:
    """Mark decoder layers to recompute activations in backward; return how many were marked.

    Uses the composable `checkpoint` API rather than `checkpoint_wrapper`, so parameter
    names (and therefore state-dict and checkpoint keys) do not change. Apply before FSDP.
    """
    if config.mode == "none":
        return 0
    if config.mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode={config.mode!r}; valid: 'none', 'full', 'selective'")
    if config.mode == "selective" and config.every < 1:
        raise ValueError(f"selective activation checkpointing needs every >= 1, got {config.every}")
    # The composable API lives in a private module; it is the one FSDP2's own tests compose with.
    from torch.distributed._composable import checkpoint

    layers = find_layer_modules(model, resolve_layer_classes(model, config.layer_classes))
    step = 1 if config.mode == "full" else config.every
    marked = 0
    for index, (_, layer) in enumerate(layers):
        if index % step == 0:
            checkpoint(layer)
            marked += 1
    return marked
