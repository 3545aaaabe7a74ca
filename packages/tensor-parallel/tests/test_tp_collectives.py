"""Exact collective counts of the built-in plans, counted with `CommDebugMode`.

Megatron tensor parallelism per decoder layer (two blocks: attention, MLP), forward:

- sequence parallel: each block all-gathers its sequence-sharded input once (``g``) and its
  row-parallel output projection reduce-scatters back to sequence shards (``g-bar``):
  2 all-gathers + 2 reduce-scatters, no all-reduce.
- no sequence parallel: each block's row-parallel output all-reduces: 2 all-reduces.

Backward mirrors it: under SP the all-gathers become reduce-scatters of the (partial)
input gradients of the column-parallel projections and vice versa (2 + 2); without SP the
identity ``f`` on each block input becomes one all-reduce per block (2). The replicated
norm weights' gradients (partial sums over sequence shards, or over head shards for
q_norm/k_norm) are *not* reduced inside backward: they stay ``Partial`` DTensors until
read (``full_tensor()``, the optimizer, FSDP's reduce-scatter).

Every count is asserted exactly, so a plan change that adds a collective (e.g. q, k and v
each all-reducing their input gradient instead of one reduce-scatter per block) fails.
Counts come from one decoder layer called directly, and from whole-model forwards whose
difference between a 2-layer and a 1-layer model is again one layer.

Rank functions are module-level so the rank pool can pickle them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

BATCH, SEQ, HIDDEN, VOCAB = 2, 8, 32, 64

AG = "all_gather_into_tensor"
RS = "reduce_scatter_tensor"
AR = "all_reduce"


def tiny_config(family: str, layers: int) -> Any:
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 64,
    }
    if family == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    return LlamaConfig(**common)


def _sharded_model(family: str, layers: int, sequence_parallel: bool) -> Any:
    from transformers import AutoModelForCausalLM

    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers), attn_implementation="sdpa")
    mesh = build_mesh(ParallelDims(dp_shard=1, tp=dist.get_world_size())).get("tp")
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    return model


def _counts(mode: Any) -> dict[str, int]:
    """{'all_gather_into_tensor': n, ...}: op names without their namespace."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].rstrip("_").removeprefix("_")
        counts[name] = counts.get(name, 0) + n
    return counts


# ---------------------------------------------------------------------------------------------- rank functions
def _layer_counts(family: str, sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    model = _sharded_model(family, 1, sequence_parallel)
    tp, rank = dist.get_world_size(), dist.get_rank()
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    position_embeddings = model.model.rotary_emb(hidden, positions)
    # Between layers the hidden state is this rank's sequence shard (SP) or the full sequence.
    chunk = SEQ // tp
    local = hidden[:, rank * chunk : (rank + 1) * chunk] if sequence_parallel else hidden
    local = local.clone().requires_grad_(True)
    layer = model.model.layers[0]
    with CommDebugMode() as forward:
        out = layer(local, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
    with CommDebugMode() as backward:
        out.sum().backward()
    norm_grads = {
        name: repr(p.grad.placements)
        for name, p in layer.named_parameters()
        if "norm" in name and isinstance(p.grad, DTensor)
    }
    return {
        "forward": _counts(forward),
        "backward": _counts(backward),
        "out_shape": tuple(out.shape),
        "out_type": type(out).__name__,
        "input_grad": local.grad is not None,
        "norm_grads": norm_grads,
    }


def _model_counts(family: str, layers: int, sequence_parallel: bool) -> dict[str, dict[str, int]]:
    from torch.distributed.tensor.debug import CommDebugMode

    model = _sharded_model(family, layers, sequence_parallel)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with CommDebugMode() as forward:
        logits = model(input_ids=ids, position_ids=positions).logits
    with CommDebugMode() as backward:
        # to_local(): a plain backward through the model, without a loss's own collectives.
        logits.to_local().sum().backward()
    return {"forward": _counts(forward), "backward": _counts(backward)}


# ---------------------------------------------------------------------------------------------- tests
# Expected counts for one decoder layer: (forward, backward).
DENSE_LAYER = {
    True: ({AG: 2, RS: 2}, {AG: 2, RS: 2}),
    False: ({AR: 2}, {AR: 2}),
}
# Qwen3-MoE: only attention is tensor-parallel. Under SP the MoE block all-gathers its input
# and slices its (replicated) output back to the local sequence shard (no communication);
# in backward the slice's gradient is all-gathered, and the input gradient (computed in full,
# identically, on every rank) is sliced: 2 all-gathers + 1 reduce-scatter each way. Without
# SP only o_proj all-reduces (forward) and the attention input gradient (backward).
MOE_LAYER = {
    True: ({AG: 2, RS: 1}, {AG: 2, RS: 1}),
    False: ({AR: 1}, {AR: 1}),
}


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_decoder_layer_collectives(family: str, sequence_parallel: bool) -> None:
    expected_forward, expected_backward = (MOE_LAYER if family == "qwen3_moe" else DENSE_LAYER)[sequence_parallel]
    for tp in (2, 4):
        for rank, res in enumerate(get_rank_pool(tp).run(_layer_counts, family, sequence_parallel)):
            where = f"tp={tp} rank={rank}"
            assert res["forward"] == expected_forward, where
            assert res["backward"] == expected_backward, where
            # The layer maps plain local tensors to plain local tensors of the same shape.
            assert res["out_type"] == "Tensor" and res["input_grad"], where
            local_seq = SEQ // tp if sequence_parallel else SEQ
            assert res["out_shape"] == (BATCH, local_seq, HIDDEN), where


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
def test_norm_weight_grads_stay_partial_until_read(sequence_parallel: bool) -> None:
    res = get_rank_pool(2).run(_layer_counts, "qwen3", sequence_parallel)[0]
    expected = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    if sequence_parallel:
        # Only SP makes the layer norms DTensors (without SP they are plain and see the full sequence).
        expected |= {"input_layernorm.weight", "post_attention_layernorm.weight"}
    assert set(res["norm_grads"]) == expected
    for name, placements in res["norm_grads"].items():
        assert placements.startswith("(Partial("), (name, placements)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
def test_whole_model_collectives(sequence_parallel: bool) -> None:
    pool = get_rank_pool(2)
    one = pool.run(_model_counts, "llama", 1, sequence_parallel)[0]
    two = pool.run(_model_counts, "llama", 2, sequence_parallel)[0]
    layer_forward, layer_backward = DENSE_LAYER[sequence_parallel]
    for phase, per_layer in (("forward", layer_forward), ("backward", layer_backward)):
        delta = {k: two[phase].get(k, 0) - one[phase].get(k, 0) for k in set(one[phase]) | set(two[phase])}
        assert {k: v for k, v in delta.items() if v} == per_layer, phase
    if sequence_parallel:
        # Outside the layers: the vocab-parallel embedding reduce-scatters to sequence shards
        # (backward: all-gathers the grad), lm_head all-gathers the final norm's output
        # (backward: reduce-scatters the partial input grad).
        assert one["forward"] == {AG: 2 + 1, RS: 2 + 1}
        assert one["backward"] == {AG: 2 + 1, RS: 2 + 1}
    else:
        # Embedding output all-reduces; lm_head's input gradient all-reduces in backward.
        assert one["forward"] == {AR: 2 + 1}
        assert one["backward"] == {AR: 2 + 1}
