"""Meta-device initialisation: build the sharded model empty, then fill it from rank 0.

Only rank 0 ever holds the full model (loaded from disk); every other rank allocates
just its shards. Values travel tensor by tensor through `set_model_state_dict` with
``broadcast_from_rank0``; non-persistent buffers (e.g. rotary ``inv_freq``, which are not
in any state dict) are broadcast separately, together with rank 0's input checks, so a bad
call raises on every rank rather than hanging the ranks that did nothing wrong.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

__all__ = ["load_full_state_dict"]


def load_full_state_dict(
    model: nn.Module,
    full_state_dict: dict[str, torch.Tensor] | None,
    *,
    device: torch.device | str,
    buffers: dict[str, torch.Tensor] | None = None,
    strict: bool = True,
) -> None:
    """Materialise a (possibly meta, possibly sharded) ``model`` on ``device`` and load weights.

    Args:
        full_state_dict: the full (unsharded) state dict on rank 0; ignored (pass None) elsewhere.
        buffers: on rank 0, all buffers of the reference model (``dict(ref.named_buffers())``),
            needed for non-persistent buffers after meta init; None elsewhere.
        strict: every entry of the full state dict must belong to ``model`` (and vice versa).
            Pass False when ``model`` holds part of the full model (e.g. pipeline stages):
            every entry is still broadcast, and each rank keeps the ones its model has.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    # Validate and share rank 0's inputs before anything is loaded: a bad call then raises the
    # same ValueError on every rank instead of leaving the others blocked in a collective.
    buffer_values = _share_buffers(model, full_state_dict, buffers if rank == 0 else None, rank)
    tied = _tied_pairs(model)
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=device)
        _retie(model, tied)
    state: dict[str, Any] = dict(full_state_dict) if rank == 0 and full_state_dict is not None else {}
    if dist.is_initialized():
        set_model_state_dict(
            model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        )
    else:
        model.load_state_dict(state, strict=strict)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffer_values[name].to(device=buf.device, dtype=buf.dtype))


def _tied_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """Pairs (alias, owner) of parameter names that share one Parameter object."""
    owners: dict[int, str] = {}
    pairs: list[tuple[str, str]] = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in owners:
                pairs.append((full, owners[id(param)]))
            else:
                owners[id(param)] = full
    return pairs


def _retie(model: nn.Module, pairs: list[tuple[str, str]]) -> None:
    # `to_empty` allocates one tensor per module attribute, which silently unties shared weights.
    for alias, owner in pairs:
        owner_param = model.get_parameter(owner)
        parent_name, _, attr = alias.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, owner_param)


def _share_buffers(
    model: nn.Module,
    full_state_dict: dict[str, torch.Tensor] | None,
    buffers: dict[str, torch.Tensor] | None,
    rank: int,
) -> dict[str, torch.Tensor]:
    """Rank 0's buffer values for every rank, or the same ValueError on every rank (one collective)."""
    names = [name for name, _ in model.named_buffers()]
    payload: list[object] = [None]
    if rank == 0:
        if full_state_dict is None:
            payload = ["rank 0 must pass the full state dict to load (other ranks pass None)"]
        elif names and buffers is None:
            payload = [
                f"model has buffers {names[:5]}... but rank 0 passed buffers=None; pass "
                "dict(reference_model.named_buffers())"
            ]
        else:
            source = buffers or {}
            missing = [n for n in names if n not in source]
            if missing:
                payload = [f"reference buffers are missing {missing}; the reference model differs from the model"]
            else:
                payload = [{n: source[n].detach().cpu() for n in names}]
    if dist.is_initialized():
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], str):
        raise ValueError(payload[0])
    values = payload[0]
    assert isinstance(values, dict)
    return values
