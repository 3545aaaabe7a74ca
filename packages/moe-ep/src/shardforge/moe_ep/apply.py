"""`apply_expert_parallel`: shard the experts of an HF MoE model and route tokens across ranks.

Strategy table (``ep`` = size of ``ep_mesh``, ``tp`` = size of ``tp_mesh``):

    ep  tp  etp   strategy
    1   1   -     replicate: every rank holds all experts (grouped matmul, no communication)
    1   >1  -     expert TP: each expert's intermediate dim split over tp (partial sums all-reduced)
    >1  1   1     EP: experts split on dim 0 over ep; tokens travel by all-to-all
    >1  >1  1     EP borrowing TP ranks: ep_mesh includes the TP ranks; each TP rank routes
                  1/tp of the (replicated) tokens, results are all-gathered over tp
    >1  >1  tp    EP + expert TP: experts split over ep, each expert's intermediate dim over tp

Expert parameters become DTensors (``Shard(0)`` over ep, the intermediate dim over tp),
so state-dict keys and global shapes stay the model's own: DCP save/load reshard across
layouts and HF export works. Under expert TP ``gate_up_proj`` is ``_StridedShard(1,
split_factor=2)`` over tp (each rank holds its slice of the gate rows and of the up rows);
`shardforge.moe_ep.strided` makes such shards checkpoint correctly.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from shardforge.mesh import ParallelDims, divisors
from shardforge.moe_ep.experts import ParallelExperts
from shardforge.moe_ep.families import family_of, find_moe_blocks
from shardforge.moe_ep.strided import register_checkpoint_hooks

__all__ = ["apply_expert_parallel", "expert_modules", "validate_expert_parallel"]


def _num_experts(config: object) -> int:
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)


def validate_expert_parallel(dims: ParallelDims, hf_config: object) -> None:
    """Check an EP/ETP layout against the model before any collective; `ValueError` says what is valid.

    Rules: ``dp_shard*cp*(tp if etp == 1 else 1) % ep == 0`` (EP borrows those ranks),
    ``num_experts % ep == 0``, and with expert TP (``ep == 1 and tp > 1``, or ``etp == tp > 1``)
    ``moe_intermediate_size % tp == 0``.
    """
    if dims.etp not in (1, dims.tp):
        raise ValueError(f"etp={dims.etp} must be 1 or equal to tp={dims.tp}")
    pool = dims.dp_shard * dims.cp * (dims.tp if dims.etp == 1 else 1)
    if dims.dp_shard > 0 and pool % dims.ep != 0:
        label = "dp_shard*cp*tp" if dims.etp == 1 else "dp_shard*cp"
        raise ValueError(
            f"ep={dims.ep} must divide {label}={pool} (expert parallelism borrows those ranks); "
            f"valid ep: {divisors(pool)}"
        )
    experts = _num_experts(hf_config)
    if dims.ep > 1 or (dims.tp > 1 and experts):
        if experts == 0:
            raise ValueError(f"ep={dims.ep} but {type(hf_config).__name__} has no experts; use ep=1")
        if experts % dims.ep != 0:
            raise ValueError(f"ep={dims.ep} must divide num_experts={experts}; valid ep: {divisors(experts)}")
    if _expert_tp(dims.ep, dims.tp, dims.etp) > 1:
        inter = int(getattr(hf_config, "moe_intermediate_size", 0) or getattr(hf_config, "intermediate_size", 0))
        if inter % dims.tp != 0:
            raise ValueError(
                f"expert tensor parallelism splits moe_intermediate_size={inter} over tp={dims.tp}; "
                f"valid tp: {divisors(inter)} (or use ep > 1 with etp=1)"
            )


def _expert_tp(ep: int, tp: int, etp: int) -> int:
    """How many ranks split each expert's intermediate dim under the strategy table."""
    if tp == 1:
        return 1
    if ep == 1:
        return tp
    return tp if etp == tp else 1


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh | None, *, tp_mesh: DeviceMesh | None = None, etp: int = 1
) -> list[ParallelExperts]:
    """Replace every MoE block's experts with `ParallelExperts`, sharded per the strategy table.

    Args:
        model: an HF MoE causal LM of a supported family (`supported_moe_families`), on any
            device including ``meta``. Apply after tensor parallelism, before FSDP.
        ep_mesh: the 1-D expert-parallel mesh (``mesh.get("ep")``), or None for ep = 1.
        tp_mesh: the 1-D tensor-parallel mesh when tp > 1 (the MoE block must see replicated
            tokens on every TP rank, as the tensor-parallel plans arrange).
        etp: 1 or tp: whether experts are also tensor-parallel when ep > 1.

    Returns the new experts modules (also found later with `expert_modules`).
    """
    family = family_of(model)
    ep = ep_mesh.size() if ep_mesh is not None else 1
    tp = tp_mesh.size() if tp_mesh is not None else 1
    for mesh, what in ((ep_mesh, "ep_mesh"), (tp_mesh, "tp_mesh")):
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"{what} must be a 1-D DeviceMesh, got {mesh.ndim}-D {mesh.mesh_dim_names}")
    if etp not in (1, tp):
        raise ValueError(f"etp={etp} must be 1 or equal to tp={tp}")
    experts_count = _num_experts(model.config)  # type: ignore[arg-type]
    if experts_count % ep != 0:
        raise ValueError(f"ep={ep} must divide num_experts={experts_count}; valid ep: {divisors(experts_count)}")
    expert_tp = _expert_tp(ep, tp, etp)
    expert_mesh, ep_placement = _expert_tp_mesh(ep_mesh, tp_mesh, expert_tp)
    replaced: list[ParallelExperts] = []
    for _, block in find_moe_blocks(model):
        old = getattr(block, family.experts_attr)
        gate_up, down = old.gate_up_proj, old.down_proj
        if expert_tp > 1:
            assert expert_mesh is not None
            inter = down.shape[2]
            if inter % tp != 0:
                raise ValueError(
                    f"moe intermediate size {inter} must be divisible by tp={tp}; valid: {divisors(inter)}"
                )
            # gate_up rows are [gate; up]: each rank takes its slice of both halves (and, with
            # ep > 1, only its experts: Shard(0) over ep on the first mesh dim).
            gate_up = _shard(gate_up, expert_mesh, [*ep_placement, _StridedShard(1, split_factor=2)])
            down = _shard(down, expert_mesh, [*ep_placement, Shard(2)])
        elif ep > 1:
            assert ep_mesh is not None
            gate_up, down = _shard(gate_up, ep_mesh, [Shard(0)]), _shard(down, ep_mesh, [Shard(0)])
        new = ParallelExperts(
            gate_up,
            down,
            old.act_fn,
            num_experts=experts_count,
            ep_group=ep_mesh.get_group() if ep > 1 and ep_mesh is not None else None,
            etp_group=tp_mesh.get_group() if expert_tp > 1 and tp_mesh is not None else None,
            token_group=tp_mesh.get_group() if ep > 1 and tp > 1 and expert_tp == 1 and tp_mesh is not None else None,
        )
        if expert_tp > 1:
            register_checkpoint_hooks(new)  # state_dict() entries DCP can save/load (strided shards)
        setattr(block, family.experts_attr, new)
        replaced.append(new)
    return replaced


def _expert_tp_mesh(
    ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, expert_tp: int
) -> tuple[DeviceMesh | None, list[Placement]]:
    """The mesh expert-TP parameters live on, and the placements before the tp one.

    EP + expert TP needs one 2-D ``(ep, tp)`` mesh (ep splits experts, tp their intermediate
    dim). Both come from the same root mesh over disjoint ranks, so they concatenate; FSDP
    over ``efsdp`` can then add its own dim to that mesh.
    """
    if expert_tp == 1:
        return None, []
    assert tp_mesh is not None
    if ep_mesh is None or ep_mesh.size() == 1:
        return tp_mesh, []
    return DeviceMesh._concatenate([ep_mesh, tp_mesh]), [Shard(0)]


def _shard(param: nn.Parameter, mesh: DeviceMesh, placements: list[Placement]) -> nn.Parameter:
    if isinstance(param, DTensor):
        raise ValueError("expert parameters are already DTensors; apply_expert_parallel must run before FSDP")
    # src_data_rank=None: every rank slices its own copy (no communication; works on meta).
    sharded = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The `ParallelExperts` modules of ``model`` (e.g. to `fully_shard` them over ``efsdp``)."""
    return [m for m in model.modules() if isinstance(m, ParallelExperts)]
