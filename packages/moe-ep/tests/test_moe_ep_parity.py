"""Expert-parallel parity: sharded MoE blocks and whole tiny MoE models equal the unsharded HF model.

Every rank builds the same seeded model. Rank 0 also runs the unsharded HF model (experts
implementation "eager": HF's per-expert loop, the reference semantics) on the *whole*
batch. The sharded copy runs each data-parallel rank's share of the batch; its loss is a
sum, so per-rank losses (and, summed over ranks, gradients) add up to the reference's.
Expert gradients are DTensors compared with ``full_tensor()``; plain gradients are summed
over the data-parallel ranks before comparing.

Tolerances (float32, CPU): the sharded path sums the same products in another order
(grouped matmul, top-k weighted sum over k instead of index_add per expert, all-to-all
moves rows without changing them). Observed differences are <= 5e-7 on logits and
<= 2e-6 on gradients; the tolerances leave ~10x headroom, while a missing reduction, a
wrong expert shard or a dropped token is off by O(1e-2) or more here.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
NUM_EXPERTS = 8
TOP_K = 2
LOGIT_TOL = {"rtol": 1e-5, "atol": 5e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 2e-5}
AUX_WEIGHT = 0.1


def tiny_config(family: str = "qwen3_moe") -> Any:
    from transformers import MixtralConfig, Qwen3MoeConfig

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": TOP_K,
    }
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            head_dim=8,
            intermediate_size=64,
            num_experts=NUM_EXPERTS,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    return MixtralConfig(intermediate_size=16, num_local_experts=NUM_EXPERTS, **common)


def build_model(family: str = "qwen3_moe", seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(family), attn_implementation="sdpa", experts_implementation="eager"
    )
    # Perturb every parameter so gradient errors that scale with them cannot hide; router
    # rows get a wide spread so top-k choices are far from ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((1.0 if name.endswith("gate.weight") else 0.05) * torch.randn_like(p))
    return model


def tokens(batch: int = 4, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy: per-rank sums add up to the whole batch's."""
    targets = torch.roll(ids, -1, dims=1)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _mesh(layout: str) -> Any:
    from shardforge.mesh import ParallelDims, build_mesh

    return build_mesh(ParallelDims.parse(layout))


# ---------------------------------------------------------------------------------------- model parity (rank fns)
def _model_parity(family: str, layout: str, fsdp: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from shardforge.moe_ep import RouterRecorder, apply_expert_parallel, expert_modules

    mesh = _mesh(layout)
    dims = mesh.dims
    model = build_model(family)
    reference = copy.deepcopy(model) if dist.get_rank() == 0 else None
    # With tp > 1 (EP + expert TP) the dense part stays replicated over tp, so the TP ranks of a
    # data-parallel rank run the same tokens, as the MoE block expects under tensor parallelism.
    tp_mesh = mesh.get("tp") if dims.tp > 1 else None
    apply_expert_parallel(model, mesh.get("ep"), tp_mesh=tp_mesh, etp=dims.etp)
    world = dist.get_world_size()
    dp_group = mesh.get("dp").get_group()
    if fsdp:
        # Experts shard over efsdp, everything else over fsdp; both average gradients over
        # the whole data-parallel world, so the loss is scaled by the world size.
        for experts in expert_modules(model):
            fully_shard(experts, mesh=mesh.get("efsdp"))
            experts.set_gradient_divide_factor(float(world))  # type: ignore[operator]
            experts.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  (gloo has no PREMUL_SUM)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh.get("fsdp"))
        fully_shard(model, mesh=mesh.get("fsdp"))
    recorder = RouterRecorder(model)
    ids = tokens().chunk(dims.dp)[mesh.local_rank("dp")]
    with recorder.record():
        logits = model(input_ids=ids).logits
    aux = recorder.aux_loss(dp_group)
    loss = token_loss(logits, ids) + AUX_WEIGHT * aux.local
    (loss * (world if fsdp else 1)).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if not fsdp and not hasattr(grad, "full_tensor"):
            grad = grad.clone()
            dist.all_reduce(grad, group=dp_group)  # plain (replicated) params: sum the per-rank partial grads
        grads[name] = _full(grad)
    gathered = [torch.empty_like(logits) for _ in range(dims.dp)]
    dist.all_gather(gathered, logits.detach().contiguous(), group=dp_group)
    out: dict[str, Any] = {
        "logits": torch.cat(gathered),
        "aux": aux.value,
        "tokens_per_expert": aux.tokens_per_expert,
        "grads": grads,
        "placements": {n: str(getattr(p, "placements", "")) for n, p in model.named_parameters() if "experts" in n},
    }
    if reference is not None:
        full_ids = tokens()
        ref = reference(input_ids=full_ids, output_router_logits=True)
        (token_loss(ref.logits, full_ids) + AUX_WEIGHT * ref.aux_loss).backward()
        out["reference"] = {
            "logits": ref.logits.detach(),
            "aux": float(ref.aux_loss),
            "grads": {n: p.grad.detach().clone() for n, p in reference.named_parameters()},
        }
    return out


MODEL_CASES = [
    pytest.param("qwen3_moe", 2, "d2e2", False, id="qwen3_moe-ep2"),
    pytest.param("qwen3_moe", 4, "d4e4", False, id="qwen3_moe-ep4"),
    pytest.param("qwen3_moe", 4, "d4e2", True, id="qwen3_moe-ep2xfsdp2"),
    pytest.param("qwen3_moe", 4, "d2t2e2x2", False, id="qwen3_moe-ep2xetp2"),
    pytest.param("mixtral", 2, "d2e2", False, id="mixtral-ep2"),
    pytest.param("mixtral", 4, "d4e2", True, id="mixtral-ep2xfsdp2"),
]


@pytest.mark.parametrize(("family", "world", "layout", "fsdp"), MODEL_CASES)
def test_model_matches_unsharded(family: str, world: int, layout: str, fsdp: bool) -> None:
    results = get_rank_pool(world).run(_model_parity, family, layout, fsdp)
    ref = results[0]["reference"]
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["logits"], ref["logits"], **LOGIT_TOL)
        assert res["aux"] == pytest.approx(ref["aux"], rel=1e-5), f"rank {rank} aux"
        assert set(res["grads"]) == set(ref["grads"])
        for name, grad in res["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
    # Experts really are split on dim 0 over ep (global names and shapes are unchanged).
    assert all("Shard(dim=0)" in p for p in results[0]["placements"].values()), results[0]["placements"]
    # Router statistics: every token picks top_k experts in each layer; none are dropped.
    counts = results[0]["tokens_per_expert"]
    assert counts.shape == (2, NUM_EXPERTS)
    assert counts.sum(dim=1).tolist() == [tokens().numel() * TOP_K] * 2
