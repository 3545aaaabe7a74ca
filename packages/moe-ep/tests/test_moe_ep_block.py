"""Expert layer parity under every strategy of the table, and routings that leave ranks empty.

Each data-parallel rank holds different tokens (a different count per rank, some not
divisible by tp); tensor-parallel ranks hold the same tokens, as the tensor-parallel plans
arrange for the MoE block. `ParallelExperts` runs on each rank's tokens with the top-k
choice and weights given; the reference is HF's eager ``Qwen3MoeExperts`` (a loop over
experts) on all tokens on one process. Compared: outputs, gradients of the inputs, of the
routing weights and of both expert weight tensors (``full_tensor()`` after summing over
the ranks that hold the same experts for different tokens).

Tolerances (float32): only summation order differs, observed <= 1e-6; a dropped token or
a wrong shard is off by >= 1e-2.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _config() -> Any:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    config._experts_implementation = "eager"
    return config


def _experts() -> torch.nn.Module:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    experts = Qwen3MoeExperts(_config())
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    return experts


def _num_tokens(dp_rank: int, route: str) -> int:
    if route == "empty_rank" and dp_rank == 1:
        return 0  # this rank routes nothing, but still joins every collective
    return 5 + 2 * dp_rank


def _inputs(dp_rank: int, route: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [T, H], top_k_index [T, K], top_k_weights [T, K], output probe [T, H]) of one dp rank."""
    gen = torch.Generator().manual_seed(100 + dp_rank)
    t = _num_tokens(dp_rank, route)
    x = torch.randn(t, HIDDEN, generator=gen)
    logits = torch.randn(t, EXPERTS, generator=gen)
    values, index = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
    if route == "one_rank":
        index = torch.arange(TOP_K).expand(t, TOP_K).contiguous()  # experts 0, 1: all on ep rank 0
    weights = values / values.sum(dim=-1, keepdim=True)
    probe = torch.randn(t, HIDDEN, generator=gen)
    return x, index, weights, probe


def _run(experts: torch.nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, probe: torch.Tensor):
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    out = experts(x, index, weights)
    (out * probe).sum().backward()
    return out.detach(), x.grad, weights.grad


def _block_parity(layout: str, route: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.moe_ep import ParallelExperts
    from shardforge.moe_ep.apply import _expert_tp, _expert_tp_mesh, _shard

    dims = ParallelDims.parse(layout)
    mesh = build_mesh(dims)
    dims = mesh.dims
    hf = _experts()
    # Build the sharded layer the way apply_expert_parallel does, on a bare experts module.
    ep_mesh = mesh.get("ep") if dims.ep > 1 else None
    tp_mesh = mesh.get("tp") if dims.tp > 1 else None
    expert_tp = _expert_tp(dims.ep, dims.tp, dims.etp)
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if expert_tp > 1:
        # ep > 1: a 2-D (ep, tp) mesh, experts Shard(0) over ep and their intermediate dim over tp.
        expert_mesh, ep_placement = _expert_tp_mesh(ep_mesh, tp_mesh, expert_tp)
        gate_up = _shard(
            torch.nn.Parameter(hf.gate_up_proj.detach().clone()),
            expert_mesh,
            [*ep_placement, _StridedShard(1, split_factor=2)],
        )
        down = _shard(torch.nn.Parameter(hf.down_proj.detach().clone()), expert_mesh, [*ep_placement, Shard(2)])
    elif ep_mesh is not None:
        gate_up = _shard(torch.nn.Parameter(hf.gate_up_proj.detach().clone()), ep_mesh, [Shard(0)])
        down = _shard(torch.nn.Parameter(hf.down_proj.detach().clone()), ep_mesh, [Shard(0)])
    else:
        gate_up, down = hf.gate_up_proj, hf.down_proj
    layer = ParallelExperts(
        gate_up,
        down,
        hf.act_fn,
        num_experts=EXPERTS,
        ep_group=ep_mesh.get_group() if ep_mesh is not None else None,
        etp_group=tp_mesh.get_group() if expert_tp > 1 else None,
        token_group=tp_mesh.get_group() if dims.ep > 1 and tp_mesh is not None and expert_tp == 1 else None,
    )
    dp_rank = mesh.local_rank("dp")
    out, grad_x, grad_w = _run(layer, *_inputs(dp_rank, route))
    grads = {}
    for name in ("gate_up_proj", "down_proj"):
        grad = getattr(layer, name).grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if mesh.has("efsdp") and dims.ep > 1:
            dist.all_reduce(local, group=mesh.get("efsdp").get_group())  # same experts, other tokens
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    result: dict[str, Any] = {"dp_rank": dp_rank, "out": out, "grad_x": grad_x, "grad_w": grad_w, "grads": grads}
    if dist.get_rank() == 0:
        parts = [_inputs(r, route) for r in range(dims.dp)]
        ref_out, ref_gx, ref_gw = _run(_experts(), *(torch.cat(p) for p in zip(*parts, strict=True)))
        ref = _experts()
        xs = torch.cat([p[0] for p in parts])
        _run(
            ref,
            xs,
            torch.cat([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]),
            torch.cat([p[3] for p in parts]),
        )
        bounds = torch.tensor([0] + [_num_tokens(r, route) for r in range(dims.dp)]).cumsum(0).tolist()
        result["reference"] = {
            "out": [ref_out[a:b] for a, b in itertools.pairwise(bounds)],
            "grad_x": [ref_gx[a:b] for a, b in itertools.pairwise(bounds)],
            "grad_w": [ref_gw[a:b] for a, b in itertools.pairwise(bounds)],
            "grads": {"gate_up_proj": ref.gate_up_proj.grad, "down_proj": ref.down_proj.grad},
        }
    return result


BLOCK_CASES = [
    pytest.param(2, "d2e2", id="ep2"),
    pytest.param(4, "d4e4", id="ep4"),
    pytest.param(2, "d1t2", id="ep1-expert_tp2"),
    pytest.param(2, "d1t2e2", id="ep2-borrow_tp2"),
    pytest.param(4, "d2t2e2", id="ep2-borrow_tp2-dp2"),
    pytest.param(4, "d2t2e4", id="ep4-borrow_tp2"),
    pytest.param(4, "d2t2e2x2", id="ep2-expert_tp2"),
]


SKEWED_CASES = [
    pytest.param(world, layout, route, id=f"{case.id}-{route}")
    for case in BLOCK_CASES
    for world, layout in [case.values]
    if case.id in ("ep2", "ep4", "ep2-borrow_tp2-dp2", "ep2-expert_tp2")
    for route in ("one_rank", "empty_rank")
]


@pytest.mark.parametrize(
    ("world", "layout", "route"), [pytest.param(*c.values, "random", id=c.id) for c in BLOCK_CASES] + SKEWED_CASES
)
def test_expert_layer_matches_hf(world: int, layout: str, route: str) -> None:
    # "one_rank": every token picks experts 0 and 1, both on ep rank 0 (the others receive
    # nothing); "empty_rank": dp rank 1 has no tokens at all. Both must complete and match.
    results = get_rank_pool(world).run(_block_parity, layout, route)
    ref = results[0]["reference"]
    for res in results:
        r = res["dp_rank"]
        torch.testing.assert_close(res["out"], ref["out"][r], **TOL)
        torch.testing.assert_close(res["grad_x"], ref["grad_x"][r], **TOL)
        torch.testing.assert_close(res["grad_w"], ref["grad_w"][r], **TOL)
        for name, grad in res["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
