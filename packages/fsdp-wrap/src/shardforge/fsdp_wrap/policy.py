"""Which modules of an HF model become FSDP units or checkpoint regions."""

from __future__ import annotations

import warnings

from torch import nn

__all__ = ["find_layer_modules", "resolve_layer_classes", "tied_embedding"]


def resolve_layer_classes(model: nn.Module, classes: tuple[str, ...] | None) -> tuple[str, ...]:
    """The class names to wrap: ``classes`` if given, else ``model._no_split_modules``."""
    if classes is not None:
        names = tuple(classes)
    else:
        names = tuple(getattr(model, "_no_split_modules", None) or ())
        if not names:
            raise ValueError(
                f"{type(model).__name__} has no `_no_split_modules`; pass the decoder-layer class names "
                "explicitly, e.g. FSDPConfig(wrap_classes=('LlamaDecoderLayer',)) or "
                "ActivationCheckpointConfig(layer_classes=('LlamaDecoderLayer',))"
            )
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if len(missing) == len(names):
        raise ValueError(
            f"none of the layer classes {list(names)} occur in {type(model).__name__}; "
            f"classes in this model include: {sorted(present)[:40]}"
        )
    return names


def find_layer_modules(model: nn.Module, classes: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) for every module whose class name is in ``classes``, in order."""
    wanted = set(classes)
    return [(name, module) for name, module in model.named_modules() if type(module).__name__ in wanted]


def tied_embedding(model: nn.Module) -> bool:
    """True when the input embedding and output projection share one weight."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return False
    emb, head = get_in(), get_out()
    if emb is None or head is None:
        return False
    return emb.weight is head.weight


def warn_tied(what: str) -> None:
    warnings.warn(
        f"the input embedding and lm_head share one weight (tied); {what} stays in the root FSDP unit "
        "so the tie is kept",
        stacklevel=3,
    )
