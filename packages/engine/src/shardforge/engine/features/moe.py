"""MoE models in the engine: expert parallelism, expert FSDP, load-balancing loss, router stats.

The engine calls, at their places in the composition order (`engine.build`, docs/parallelism.md):

- the layout checks live in `shardforge.engine.checks` (run before any collective);
- `apply_moe` after tensor parallelism: experts become `ParallelExperts` (EP over ``ep``,
  expert TP, EP + expert TP, or replicated with the grouped matmul) per the moe-ep strategy table;
- `reload_expert_tp` right after the generic full-state-dict load, and
  `register_moe_checkpoint_hooks` on the optimizer: expert-TP shards (``_StridedShard``) are
  loaded from rank 0 row range by row range and checkpointed chunk by chunk (torch 2.13's
  broadcast load and DCP describe such a shard by one offset, i.e. wrongly);
- `shard_experts` right before FSDP: each experts module is its own FSDP unit over
  ``efsdp`` (so the decoder-layer units, sharded over ``fsdp``, skip expert params);
- `MoETraining` around each training micro-batch: records router logits and adds the
  global load-balancing loss (weight ``EngineConfig.moe_aux_loss_weight``).

Gradient scaling: the engine multiplies each rank's loss by dp_cp / global weight and FSDP
averages dense gradients over the dp_cp ranks. An expert shard's gradient already sums the
tokens of its whole EP group (all-to-all), so its FSDP unit divides by dp_cp (not by the
efsdp size it reduces over): the update equals the one-process update.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardforge.engine.context import ParallelContext
from shardforge.fsdp_wrap import FSDPConfig, offload_policy
from shardforge.mesh import ParallelDims, ParallelMesh
from shardforge.moe_ep import (
    MOE_FAMILIES,
    RouterRecorder,
    apply_expert_parallel,
    broadcast_full_tensors_,
    expert_modules,
    register_optimizer_checkpoint_hooks,
)
from shardforge.moe_ep.strided import has_strided_shard

__all__ = [
    "MoETraining",
    "apply_moe",
    "aux_term",
    "is_moe",
    "moe_stats",
    "moe_training",
    "recording",
    "register_moe_checkpoint_hooks",
    "reload_expert_tp",
    "shard_experts",
]


def is_moe(hf_config: Any) -> bool:
    """Whether the model is a sparse MoE family that moe-ep supports."""
    return getattr(hf_config, "model_type", None) in MOE_FAMILIES


def _expert_meshes(mesh: ParallelMesh, dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh]:
    """(ep mesh, efsdp mesh) from the same split of the expert pool."""
    if mesh.has("efsdp") and dims.efsdp > 1:
        return mesh.get("ep"), mesh.get("efsdp")
    # efsdp == 1: still give experts their own (one-rank) FSDP unit, so the decoder-layer
    # units over ``fsdp`` do not try to shard the EP-sharded expert DTensors again.
    split = mesh.get("ep")._unflatten(0, (1, dims.ep), ("moe_efsdp", "moe_ep"))
    return split["moe_ep"], split["moe_efsdp"]


def apply_moe(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh | None) -> DeviceMesh | None:
    """Install `ParallelExperts` per the strategy table; return the efsdp mesh experts shard over
    (None when experts stay ordinary parameters of the decoder-layer FSDP units). No-op for dense models."""
    if not is_moe(getattr(model, "config", None)):
        return None
    if mesh is None or (dims.ep == 1 and dims.tp == 1):
        apply_expert_parallel(model, None)  # replicated experts, grouped matmul
        return None
    if dims.ep == 1 and dims.pp > 1:
        # Pipeline stages load their weights through their own path, which does not re-load
        # expert-TP (_StridedShard) shards: keep experts replicated over tp there.
        apply_expert_parallel(model, None)
        return None
    if dims.ep == 1:
        # Expert TP: each expert's intermediate dim over tp (the TP plan gives the MoE block the
        # full sequence); the experts stay in the decoder-layer FSDP units over fsdp.
        apply_expert_parallel(model, None, tp_mesh=mesh.get("tp"))
        return None
    tp_mesh = mesh.get("tp") if dims.tp > 1 else None
    ep_mesh, efsdp_mesh = _expert_meshes(mesh, dims)
    apply_expert_parallel(model, ep_mesh, tp_mesh=tp_mesh, etp=dims.etp)
    return efsdp_mesh


def reload_expert_tp(model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None) -> None:
    """Re-load expert-TP parameters from rank 0's full state dict (collective; no-op without them).

    Call right after `load_full_state_dict`: torch 2.13's ``set_model_state_dict(...,
    broadcast_from_rank0=True)`` copies one contiguous block into a ``_StridedShard`` shard,
    while the rank needs its gate rows and its up rows. Every rank checks the same model, so
    all join the broadcasts or none does.
    """
    if dist.is_initialized() and any(has_strided_shard(p) for p in model.parameters()):
        broadcast_full_tensors_(model, full_state_dict)


def register_moe_checkpoint_hooks(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` list expert-TP states chunk by chunk, as the experts modules
    already do for their parameters (so DCP saves and loads them exactly). No-op otherwise."""
    if any(has_strided_shard(p) for p in model.parameters()):
        register_optimizer_checkpoint_hooks(optimizer)


def shard_experts(model: nn.Module, efsdp_mesh: DeviceMesh | None, dims: ParallelDims, config: FSDPConfig) -> None:
    """One FSDP unit per experts module over ``efsdp`` (call before the decoder layers are wrapped;
    no-op when `apply_moe` returned no mesh)."""
    if efsdp_mesh is None:
        return
    for experts in expert_modules(model):
        fully_shard(
            experts,
            mesh=efsdp_mesh,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype),
            offload_policy=offload_policy(config.cpu_offload),
        )
        experts.set_gradient_divide_factor(float(dims.dp_cp))  # type: ignore[operator]
        if efsdp_mesh.size() > 1 and dist.get_backend(efsdp_mesh.get_group()) == "gloo":
            # A divide factor other than the group size is NCCL's PREMUL_SUM, which gloo lacks:
            # sum, then divide. (On a one-rank mesh FSDP divides in its local copy already.)
            experts.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


class MoETraining:
    """Router recording + global load-balancing loss for the engine's training micro-batches.

    Args:
        model: the (sharded) MoE model.
        weight: multiplier of the aux loss in the training objective.
        group: ranks holding different tokens (dp x cp), None on one rank.
        dp_cp: the number of ranks FSDP averages dense gradients over.
        cp_rank, cp: this rank's context-parallel coordinate and size (the MoE blocks see
            this rank's chunk of each padded sequence).
    """

    def __init__(
        self, model: nn.Module, *, weight: float, group: dist.ProcessGroup | None, dp_cp: int, cp_rank: int, cp: int
    ) -> None:
        self.recorder = RouterRecorder(model)
        self.weight = weight
        self.group = group
        self.dp_cp = dp_cp
        self.cp_rank, self.cp = cp_rank, cp
        self._num_tokens = 0
        self._real = True
        self._aux: list[float] = []
        self._counts: torch.Tensor | None = None

    @contextmanager
    def record(self, num_tokens: int, *, real: bool) -> Iterator[None]:
        """Record the routers during one micro-batch forward (``real=False``: a dummy, all masked)."""
        self._num_tokens, self._real = num_tokens, real
        with self.recorder.record():
            yield

    def aux_term(self, num_microbatches: int) -> torch.Tensor:
        """This rank's share of ``weight * aux / num_microbatches``, scaled for FSDP averaging.

        Collective over the dp x cp group (every rank calls it once per micro-batch).
        """
        # Rows past the micro-batch's tokens are padding (to a multiple of cp x tp); a dummy
        # micro-batch is all padding. This rank's routers saw chunk ``cp_rank`` of the sequence.
        rows = self.recorder.recorded_rows
        position = torch.arange(self.cp_rank * rows, (self.cp_rank + 1) * rows)
        mask = (position < self._num_tokens).float() if self._real else torch.zeros(rows)
        aux = self.recorder.aux_loss(self.group, token_mask=mask)
        self._aux.append(aux.value)
        counts = aux.tokens_per_expert
        self._counts = counts if self._counts is None else self._counts + counts
        return aux.local * (self.weight * self.dp_cp / num_microbatches)

    def pop_stats(self) -> dict[str, float]:
        """Router statistics of the last step (mean aux over micro-batches; counts summed)."""
        if not self._aux or self._counts is None:
            return {}
        from shardforge.moe_ep import AuxLoss

        summary = AuxLoss(
            local=torch.zeros(()),
            value=sum(self._aux) / len(self._aux),
            tokens_per_expert=self._counts,
            num_tokens=0,
        )
        self._aux, self._counts = [], None
        return summary.stats()


def moe_training(model: nn.Module, hf_config: Any, ctx: ParallelContext) -> MoETraining | None:
    """The engine's `MoETraining` (None for dense models)."""
    if not is_moe(hf_config):
        return None
    weight = ctx.config.moe_aux_loss_weight
    if weight is None:
        weight = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    mesh = ctx.mesh
    group = mesh.get("dp_cp").get_group() if mesh is not None and mesh.has("dp_cp") else None
    return MoETraining(model, weight=weight, group=group, dp_cp=ctx.dims.dp_cp, cp_rank=ctx.cp_rank, cp=ctx.dims.cp)


def recording(moe: MoETraining | None, num_tokens: int, real: bool) -> Any:
    """``moe.record(...)`` or a no-op context for dense models."""
    return moe.record(num_tokens, real=real) if moe is not None else nullcontext()


def aux_term(moe: MoETraining | None, num_microbatches: int) -> torch.Tensor | float:
    """`MoETraining.aux_term`, or 0.0 for dense models."""
    return moe.aux_term(num_microbatches) if moe is not None else 0.0


def moe_stats(moe: MoETraining | None) -> dict[str, float]:
    """`MoETraining.pop_stats`, or nothing for dense models."""
    return moe.pop_stats() if moe is not None else {}
