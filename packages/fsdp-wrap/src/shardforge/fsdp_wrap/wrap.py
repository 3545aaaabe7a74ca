"""`apply_fsdp`: FSDP2 (`fully_shard`) over decoder layers, embeddings, lm_head and the root."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from shardforge.fsdp_wrap.config import FSDPConfig
from shardforge.fsdp_wrap.policy import find_layer_modules, resolve_layer_classes, tied_embedding, warn_tied

__all__ = ["apply_fsdp"]


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, config: FSDPConfig | None = None) -> nn.Module:
    """Shard ``model`` in place with FSDP2 and return it.

    ``mesh`` is 1-D (FSDP: shard over all its ranks) or 2-D ``(replicate, shard)`` (HSDP:
    shard within a row, replicate across rows, all-reduce gradients between replicas).
    Each decoder layer is one unit (one all-gather per layer; ``config.layers_per_unit``
    consecutive layers share one); embeddings and lm_head are their own units unless tied; the
    root unit holds whatever is left (e.g. the final norm). ``config.forward_prefetch`` units are
    all-gathered ahead in forward and backward. Works on a meta-device model: materialise it
    afterwards (see `load_full_state_dict`).
    """
    config = config or FSDPConfig()
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"apply_fsdp needs a 1-D (shard) or 2-D (replicate, shard) mesh, got {mesh.ndim}-D "
            f"with dims {mesh.mesh_dim_names}; e.g. mesh.get('fsdp') or mesh.get(('dp_replicate', 'fsdp'))"
        )
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype),
        "offload_policy": offload_policy(config.cpu_offload),
    }
    layer_classes = resolve_layer_classes(model, config.wrap_classes)
    layers = [layer for _, layer in find_layer_modules(model, layer_classes)]
    tied = tied_embedding(model)
    groups = _units(layers, config.layers_per_unit, config.keep_input_dtype_classes)
    keep_inputs = {
        **kwargs,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype, cast_forward_inputs=False
        ),
    }
    for index, group in enumerate(groups):
        # The last unit's params are needed again right at the start of backward, so
        # resharding it after forward only costs an extra all-gather (torchtitan does the same).
        reshard = config.reshard_after_forward and index < len(groups) - 1
        unit_kwargs = keep_inputs if type(group[0]).__name__ in config.keep_input_dtype_classes else kwargs
        fully_shard(group if len(group) > 1 else group[0], reshard_after_forward=reshard, **unit_kwargs)
    if config.forward_prefetch > 0:
        _prefetch([group[0] for group in groups], config.forward_prefetch)
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if config.wrap_embeddings and get_in is not None and get_in() is not None:
        if tied:
            warn_tied("the input embedding")
        else:
            fully_shard(get_in(), reshard_after_forward=config.reshard_after_forward, **kwargs)
    if config.wrap_lm_head and get_out is not None and get_out() is not None:
        if tied:
            warn_tied("lm_head")
        else:
            # lm_head runs last in forward and first in backward: keep it gathered in between.
            fully_shard(get_out(), reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=config.reshard_after_forward, **kwargs)
    return model


def _units(layers: list[nn.Module], step: int, keep: tuple[str, ...]) -> list[list[nn.Module]]:
    """Consecutive layers, ``step`` per unit; a unit never mixes layers whose inputs are cast with ones
    in ``keep`` (e.g. a VLM's vision blocks and its decoder layers: each unit has one policy)."""
    runs: list[list[nn.Module]] = []
    for layer in layers:
        if runs and (type(runs[-1][0]).__name__ in keep) == (type(layer).__name__ in keep):
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return [run[i : i + step] for run in runs for i in range(0, len(run), step)]


def _prefetch(units: list[nn.Module], ahead: int) -> None:
    """Issue the all-gathers of the next ``ahead`` units in forward and of the previous ones in backward.
    ``units`` are each unit's first module (FSDP2 puts the unit's state on every module of a group)."""
    for i, unit in enumerate(units):
        later = units[i + 1 : i + 1 + ahead]
        earlier = units[max(0, i - ahead) : i][::-1]
        if later:
            unit.set_modules_to_forward_prefetch(later)  # type: ignore[operator]
        if earlier:
            unit.set_modules_to_backward_prefetch(earlier)  # type: ignore[operator]


def offload_policy(cpu_offload: bool) -> OffloadPolicy:
    """FSDP2's CPU offload policy (params, grads and optimizer state in host memory) or none.

    Host memory is pinned only where an accelerator exists: pinning needs one (on a CPU-only machine
    torch raises "Cannot access accelerator device"), and without one there is no copy to speed up.
    """
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
