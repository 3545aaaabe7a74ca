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
    Each decoder layer is one unit (one all-gather per layer); embeddings and lm_head are
    their own units unless tied; the root unit holds whatever is left (e.g. the final norm).
    Works on a meta-device model: materialise it afterwards (see `load_full_state_dict`).
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
    layers = find_layer_modules(model, layer_classes)
    tied = tied_embedding(model)
    for index, (_, layer) in enumerate(layers):
        # The last layer's params are needed again right at the start of backward, so
        # resharding it after forward only costs an extra all-gather (torchtitan does the same).
        reshard = config.reshard_after_forward and index < len(layers) - 1
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
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


def offload_policy(cpu_offload: bool) -> OffloadPolicy:
    """FSDP2's CPU offload policy (params, grads and optimizer state in host memory) or none.

    Host memory is pinned only where an accelerator exists: pinning needs one (on a CPU-only machine
    torch raises "Cannot access accelerator device"), and without one there is no copy to speed up.
    """
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
