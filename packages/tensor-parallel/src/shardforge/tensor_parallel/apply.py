"""`apply_tensor_parallel`: shard an HF decoder over a TP mesh with a plan (data)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from shardforge.tensor_parallel.plans import TPPlan, plan_for_model
from shardforge.tensor_parallel.validate import validate_tp

__all__ = ["apply_tensor_parallel"]


def _tied(model: nn.Module) -> bool:
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None or get_in() is None or get_out() is None:
        return False
    return get_in().weight is get_out().weight


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    plan: TPPlan | None = None,
    sequence_parallel: bool = True,
) -> None:
    """Shard ``model`` in place over the 1-D ``tp_mesh``.

    With the built-in plans the model's forward then expects input ids replicated on the
    TP ranks with a sequence length divisible by tp (when ``sequence_parallel``), and
    returns vocab-sharded logits as a `DTensor` (``Shard(-1)``): compute losses with
    `vocab_parallel_logprobs` / `vocab_parallel_entropy` / `vocab_parallel_cross_entropy`.
    Apply before FSDP. Works on meta-device models.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D TP mesh, got dims {tp_mesh.mesh_dim_names}")
    config = getattr(model, "config", None)
    if config is not None:
        validate_tp(config, tp_mesh.size())
    if plan is None:
        plan = plan_for_model(model, sequence_parallel=sequence_parallel)
    tied = _tied(model)
    parallelize_module(model, tp_mesh, plan)
    if tied:
        # Embedding rows and lm_head output rows are both sharded on dim 0 (Shard(0)), so
        # the shared weight stays one parameter after sharding.
        model.get_output_embeddings().weight = model.get_input_embeddings().weight  # type: ignore[operator]
