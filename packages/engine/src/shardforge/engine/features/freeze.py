"""Freeze modules by name prefix (``EngineConfig.freeze_module_prefix``), e.g. a VLM's vision tower.

Applied in `shardforge.engine.build.build_model` to the rank-0 reference model and to the
meta-device model *before* tensor parallelism and FSDP, so every later step sees plain
``requires_grad=False`` parameters: autograd leaves their ``.grad`` at None, FSDP2 reduce-scatters
only parameters that have a gradient (a frozen parameter costs no gradient communication), the
optimizer is built over ``requires_grad`` parameters only (no Adam state for them), and the gradient
norm and clipping skip them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["freeze_module_prefixes", "module_names"]


def module_names(model: nn.Module, depth: int = 2) -> list[str]:
    """Qualified names of ``model``'s modules up to ``depth`` dots deep (what a prefix can name)."""
    return [name for name, _ in model.named_modules() if name and name.count(".") < depth]


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def freeze_module_prefixes(model: nn.Module, prefixes: Sequence[str]) -> int:
    """Set ``requires_grad=False`` on every parameter under a module named by one of ``prefixes``
    (a qualified module name, e.g. ``model.visual``; matched on whole name components, so
    ``model.vis`` matches nothing). Return the number of frozen parameter elements.

    Raises `ValueError` when a prefix matches no parameter, listing the model's module names.
    """
    names = [name for name, _ in model.named_parameters()]
    unmatched = [p for p in prefixes if not any(_matches(n, p) for n in names)]
    if unmatched:
        raise ValueError(
            f"engine.freeze_module_prefix {unmatched} matches no parameter of {type(model).__name__}; a prefix "
            f"is a qualified module name. Module names in this model: {module_names(model)[:40]}"
        )
    frozen = 0
    for name, param in model.named_parameters():
        if any(_matches(name, p) for p in prefixes):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen
