"""`apply_replicate`: plain data parallelism (DDP) for models whose whole state fits one device.

FSDP2 pays an all-gather per unit in forward (and again in backward when resharded) and a
reduce-scatter per unit; on a small model those per-layer collectives cost more than the math.
DDP keeps a full replica per rank and all-reduces gradients in buckets, overlapped with the
backward pass (the bucket of the last layers is reduced while earlier layers still compute).
This is torch's composable ``replicate`` (DDP's reducer behind the composable API), so the module
keeps its parameter names and state-dict keys.

Unlike `apply_fsdp`, it needs a materialised module on its device (DDP broadcasts rank 0's
parameters and registers hooks on real tensors): load the weights first.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_replicate"]


def apply_replicate(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    bucket_cap_mb: float = 25.0,
) -> nn.Module:
    """Replicate ``model`` over the ranks of the 1-D ``mesh`` (DDP) in place and return it.

    Gradients are averaged over the mesh (as DDP does), in buckets of ``bucket_cap_mb`` MiB
    overlapped with backward. Parameters must already hold their values (not on the meta device).
    """
    from torch.distributed._composable import replicate

    if mesh.ndim != 1:
        raise ValueError(
            f"apply_replicate needs a 1-D mesh (the data-parallel ranks), got {mesh.ndim}-D with dims "
            f"{mesh.mesh_dim_names}; e.g. mesh.get('dp_replicate')"
        )
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"apply_replicate needs materialised parameters, but {len(meta)} are on the meta device "
            f"(first: {meta[0]!r}); load the weights first (e.g. load_full_state_dict), then replicate"
        )
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb)
    return model
