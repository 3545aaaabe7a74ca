"""`apply_replicate` (DDP): a replicated train step equals the single-process step on the whole batch.

Each rank gets half of one batch of equal-length rows; the reference runs the whole batch. The
loss is a mean, so the reference gradient is the mean of the per-rank gradients: exactly what
DDP's bucketed all-reduce-and-average must produce. Summing instead of averaging, or skipping a
bucket, moves gradients by O(100%), far outside the tolerance (float32 reduction-order noise:
observed <= 1e-7 here). Rank functions are module-level so the rank pool can pickle them.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _replicated_grads(bucket_cap_mb: float) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardforge.fsdp_wrap import apply_replicate

    model = _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    apply_replicate(model, mesh, bucket_cap_mb=bucket_cap_mb)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = x.shape[0] // world
    model(x[rank * rows : (rank + 1) * rows]).pow(2).mean().backward()
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "keys": list(model.state_dict()),
    }


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-4])  # one bucket; one bucket per parameter
def test_replicate_grads_match_the_whole_batch_on_one_process(bucket_cap_mb: float) -> None:
    reference = _model()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    reference(x).pow(2).mean().backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for result in get_rank_pool(2).run(_replicated_grads, bucket_cap_mb):
        assert result["keys"] == list(reference.state_dict())  # names unchanged (checkpoints, HF export)
        for name, grad in expected.items():
            torch.testing.assert_close(result["grads"][name], grad, **GRAD_TOL, msg=name)


def test_replicate_refuses_meta_parameters_and_multi_dim_meshes() -> None:
    from shardforge.fsdp_wrap import apply_replicate

    class FakeMesh:
        ndim = 2
        mesh_dim_names = ("a", "b")

    with pytest.raises(ValueError, match="1-D mesh"):
        apply_replicate(_model(), FakeMesh())  # type: ignore[arg-type]

    class OneDim:
        ndim = 1
        mesh_dim_names = ("dp",)

    with torch.device("meta"):
        meta = copy.deepcopy(_model()).to("meta")
    with pytest.raises(ValueError, match="materialised parameters"):
        apply_replicate(meta, OneDim())  # type: ignore[arg-type]
