"""Tensor (+ sequence) parallel parity: a TP-sharded HF decoder equals the unsharded model.

Every rank builds the same seeded model; rank 0 also keeps an unsharded copy as reference.
The sharded copy goes through `apply_tensor_parallel` on a 1-D TP mesh over the whole pool
and runs the same replicated [B, S] batch (HF SDPA attention, causal, no padding). Its loss
is ``-sum(w * vocab_parallel_logprobs(logits, targets))`` on the vocab-sharded logits; the
reference uses ``log_softmax`` on its dense logits. Compared: logits (``full_tensor()``) and
every parameter gradient (``full_tensor()`` for DTensor grads; plain grads, e.g. of the
replicated MoE block, are compared on every rank, so a rank-local partial grad fails).

Rank functions are module-level so the rank pool can pickle them; transformers and the
package are imported inside them (the workers import them once, the pytest process never
needs the modeling code).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
BATCH = 2
SEQ = 8  # divisible by tp in {2, 4}: sequence parallelism splits it across the TP ranks
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"]

# Tolerances, float32 on CPU. The sharded model computes the same sums in a different order
# (per-rank partial matmuls, then a reduce-scatter / all-reduce; vocab-parallel softmax
# statistics combined across ranks), so results differ by float32 rounding only: observed
# <= 4e-7 on logits of magnitude <= 1.3 and <= 4e-6 on gradients of magnitude <= 6.2, for
# every family, tp and sp setting. The tolerances leave ~10x headroom; a real fault (a
# missing reduction, a rank-partial grad, a wrong shard) is off by O(grad), >= 1e-2 here.
LOGIT_TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-4, "atol": 3e-5}


def tiny_config(family: str, *, tie: bool = False, heads: int = 4, kv_heads: int = 4) -> Any:
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if family == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tie,
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
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    return cls(**common)


def build_model(family: str, *, tie: bool = False, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tie=tie), attn_implementation="sdpa")
    # Perturb every parameter: HF initialises norm weights to exactly 1 and biases to 0, so
    # gradient errors that scale with them would otherwise hide.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [B, S], position_ids [B, S], targets [B, S], per-token loss weights [B, S])."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    # Position ids are passed explicitly: with sequence parallelism HF would otherwise derive
    # them from the (sequence-sharded) embeddings' local length.
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    targets = torch.roll(ids, -1, dims=1)
    weights = torch.rand(BATCH, SEQ, generator=gen) + 0.5
    return ids, pos, targets, weights


def _tp_mesh() -> Any:
    from shardforge.mesh import ParallelDims, build_mesh

    return build_mesh(ParallelDims(dp_shard=1, tp=dist.get_world_size())).get("tp")


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _dense_run(model: torch.nn.Module) -> dict[str, Any]:
    ids, pos, targets, weights = batch()
    logits = model(input_ids=ids, position_ids=pos).logits
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (-(logp * weights).sum()).backward()
    return {
        "logits": logits.detach(),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
    }


def _sharded_run(model: torch.nn.Module) -> dict[str, Any]:
    from shardforge.tensor_parallel import vocab_parallel_logprobs

    ids, pos, targets, weights = batch()
    logits = model(input_ids=ids, position_ids=pos).logits
    logp = vocab_parallel_logprobs(logits, targets)
    (-(logp * weights).sum()).backward()
    return {
        "logits": _full(logits),
        "logits_type": type(logits).__name__,
        "grads": {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None},
        "params": sorted(n for n, _ in model.named_parameters()),
    }


# ---------------------------------------------------------------------------------------------- rank functions
def _parity(family: str, sequence_parallel: bool, tie: bool = False, plan: Any = None) -> dict[str, Any]:
    from shardforge.tensor_parallel import apply_tensor_parallel

    model = build_model(family, tie=tie)
    reference = copy.deepcopy(model) if dist.get_rank() == 0 else None
    apply_tensor_parallel(model, _tp_mesh(), plan=plan, sequence_parallel=sequence_parallel)
    out = _sharded_run(model)
    out["lm_head_is_embedding"] = model.lm_head.weight is model.model.embed_tokens.weight
    out["reference"] = _dense_run(reference) if reference is not None else None
    return out


def _qk_norm_placements(sequence_parallel: bool) -> dict[str, str]:
    from shardforge.tensor_parallel import apply_tensor_parallel

    model = build_model("qwen3")
    apply_tensor_parallel(model, _tp_mesh(), sequence_parallel=sequence_parallel)
    return {n: repr(getattr(p, "placements", "plain")) for n, p in model.named_parameters() if "_norm" in n}


def _apply_error(family: str, **kwargs: Any) -> str:
    from torch.distributed.tensor import DTensor

    from shardforge.tensor_parallel import apply_tensor_parallel

    model = build_model(family) if family != "gpt2" else _gpt2()
    try:
        apply_tensor_parallel(model, _tp_mesh(), **kwargs)
    except ValueError as err:
        # Nothing was sharded: the error came before parallelize_module (and its collectives).
        sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
        return f"{err} || sharded={sharded}"
    return "no error"


def _gpt2() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config("gpt2"))


def _two_d_mesh_error() -> str:
    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.tensor_parallel import apply_tensor_parallel

    mesh = build_mesh(ParallelDims(dp_shard=2, tp=2)).get(("fsdp", "tp"))
    try:
        apply_tensor_parallel(build_model("llama"), mesh)
    except ValueError as err:
        return str(err)
    return "no error"


def _invalid_heads_error() -> str:
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from shardforge.tensor_parallel import apply_tensor_parallel

    # heads=4, kv_heads=2: tp=4 would need half a KV head per rank.
    model = AutoModelForCausalLM.from_config(tiny_config("llama", heads=4, kv_heads=2), attn_implementation="sdpa")
    try:
        apply_tensor_parallel(model, _tp_mesh())
    except ValueError as err:
        sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
        return f"{err} || sharded={sharded}"
    return "no error"


def _meta_apply() -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from shardforge.tensor_parallel import apply_tensor_parallel

    # How the engine uses it: shard the meta-device skeleton, load weights afterwards.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3", tie=True), attn_implementation="sdpa")
    apply_tensor_parallel(model, _tp_mesh())
    return {
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "placements": {n: repr(getattr(p, "placements", None)) for n, p in model.named_parameters()},
        "devices": {str(p.device) for p in model.parameters()},
        "local_q": tuple(model.model.layers[0].self_attn.q_proj.weight.to_local().shape),
    }


def _mlp_only_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # Plain Megatron MLP sharding, no sequence parallelism: the block input is the replicated
    # hidden state, down_proj all-reduces back to a replicated (plain) output.
    return {
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    }


def _custom_plan_parity() -> dict[str, Any]:
    return _parity("llama", False, plan=_mlp_only_plan())


# ---------------------------------------------------------------------------------------------- checks
def _check_parity(results: list[dict[str, Any]], *, expect_dtensor_logits: bool = True) -> None:
    ref = results[0]["reference"]
    assert ref is not None
    assert ref["grads"], "reference produced no gradients"
    for rank, res in enumerate(results):
        if expect_dtensor_logits:
            assert res["logits_type"] == "DTensor", "built-in plans return vocab-sharded DTensor logits"
        torch.testing.assert_close(res["logits"], ref["logits"], **LOGIT_TOL, msg=lambda m, r=rank: f"rank {r}: {m}")
        # Every parameter that gets a gradient unsharded gets the same gradient sharded.
        assert sorted(res["grads"]) == sorted(ref["grads"]), f"rank {rank}: parameters with grads differ"
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(
                res["grads"][name], grad, **GRAD_TOL, msg=lambda m, r=rank, n=name: f"rank {r}, grad of {n}: {m}"
            )


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_parity_logits_and_all_grads(family: str, tp: int, sequence_parallel: bool) -> None:
    _check_parity(get_rank_pool(tp).run(_parity, family, sequence_parallel))


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
def test_qwen3_qk_norm_weights_are_replicated_dtensors(sequence_parallel: bool) -> None:
    placements = get_rank_pool(2).run(_qk_norm_placements, sequence_parallel)[0]
    for name in ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"):
        assert placements[name] == "(Replicate(),)", f"{name}: {placements[name]}"


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
def test_qwen3_qk_norm_grads_match(sequence_parallel: bool) -> None:
    results = get_rank_pool(4).run(_parity, "qwen3", sequence_parallel)
    ref = results[0]["reference"]["grads"]
    names = [n for n in ref if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(names) == 4  # 2 layers x (q_norm, k_norm)
    for rank, res in enumerate(results):
        for name in names:
            torch.testing.assert_close(
                res["grads"][name], ref[name], **GRAD_TOL, msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}"
            )


def test_qwen3_qk_norm_left_plain_gives_partial_grads() -> None:
    """The regression the test above guards against: without the q_norm/k_norm entries the
    weights stay plain per-rank tensors and each rank's grad only covers its own heads."""
    from shardforge.tensor_parallel import dense_decoder_plan

    plan = dense_decoder_plan(sequence_parallel=True, qk_norm=False)
    results = get_rank_pool(2).run(_parity, "qwen3", True, False, plan)
    ref = results[0]["reference"]["grads"]
    for name in ("model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"):
        for res in results:
            with pytest.raises(AssertionError):
                torch.testing.assert_close(res["grads"][name], ref[name], **GRAD_TOL)
        # Summing the per-rank partial grads recovers the true one: they really are partial.
        torch.testing.assert_close(sum(r["grads"][name] for r in results), ref[name], **GRAD_TOL)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
def test_tied_embeddings_stay_tied_and_match(sequence_parallel: bool) -> None:
    results = get_rank_pool(2).run(_parity, "qwen3", sequence_parallel, True)
    assert all(r["lm_head_is_embedding"] for r in results)
    # One shared parameter: named_parameters() lists it once, under the embedding's name.
    assert "lm_head.weight" not in results[0]["params"]
    assert "model.embed_tokens.weight" in results[0]["params"]
    _check_parity(results)


def test_untied_model_keeps_separate_lm_head() -> None:
    results = get_rank_pool(2).run(_parity, "qwen3", True)
    assert not results[0]["lm_head_is_embedding"]
    assert "lm_head.weight" in results[0]["params"]


def test_unsupported_family_lists_supported_and_plan_kwarg() -> None:
    message = get_rank_pool(2).run(_apply_error, "gpt2")[0]
    assert "gpt2" in message
    for family in FAMILIES:
        assert repr(family) in message, message
    assert "plan=" in message
    assert "sharded=[]" in message


def test_custom_plan_on_any_model() -> None:
    results = get_rank_pool(2).run(_custom_plan_parity)
    # The MLP-only plan leaves lm_head alone: logits are a plain tensor, which the
    # vocab-parallel loss also accepts.
    assert results[0]["logits_type"] == "Tensor"
    _check_parity(results, expect_dtensor_logits=False)


def test_two_dimensional_mesh_is_rejected() -> None:
    message = get_rank_pool(4).run(_two_d_mesh_error)[0]
    assert "1-D TP mesh" in message and "'tp')" in message, message


def test_indivisible_heads_fail_before_sharding() -> None:
    message = get_rank_pool(4).run(_invalid_heads_error)[0]
    assert "num_key_value_heads=2" in message, message
    assert "valid tp for this model: [1, 2]" in message, message
    assert "sharded=[]" in message, message


def test_meta_device_model_is_sharded_without_materialising() -> None:
    res = get_rank_pool(2).run(_meta_apply)[0]
    assert res["tied"]
    assert res["devices"] == {"meta"}
    assert res["local_q"] == (16, 32)  # 4 heads x head_dim 8 = 32 rows, half per rank
    placements = res["placements"]
    assert placements["model.embed_tokens.weight"] == "(Shard(dim=0),)"
    assert placements["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=1),)"
    assert placements["model.layers.0.mlp.gate_proj.weight"] == "(Shard(dim=0),)"
    assert placements["model.norm.weight"] == "(Replicate(),)"
    assert "None" not in placements.values(), "every parameter of a built-in plan is a DTensor"
