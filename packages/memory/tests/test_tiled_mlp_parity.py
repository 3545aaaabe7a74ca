"""Tiled MLP on one process: whole-model loss, logits and every gradient vs the untiled model.

Tolerance. With num_shards=1 the same kernels run on the same shapes: exact. With more
chunks each parameter gradient is a sum over chunks of per-chunk sums (a different fp32
summation order), and matmuls on few rows may take another kernel path: observed <= 6e-8
absolute on values of magnitude <= 1 (logits, grads). rtol/atol 1e-5/1e-6 leave >10x
headroom; a real fault (a dropped or doubled chunk, a missing parameter gradient) is off by
a whole chunk's contribution, >= 1e-3 here.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from shardforge.memory import apply_tiled_mlp

VOCAB = 64
TOL: dict[str, float] = {"rtol": 1e-5, "atol": 1e-6}


def tiny_model(family: str, **overrides: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        **overrides,
    }
    if family == "qwen3":
        config: Any = Qwen3Config(head_dim=8, **common)
    elif family == "llama":
        config = LlamaConfig(**common)
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **common)
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    # Norm weights start at exactly 1: perturb everything so gradient errors cannot hide.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, *, use_autograd_grad: bool = False) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    names, params = zip(*model.named_parameters())
    if use_autograd_grad:
        grads = torch.autograd.grad(loss, params)
    else:
        loss.backward()
        grads = tuple(p.grad for p in params)
    return {"loss": loss.detach(), "logits": logits.detach(), "grads": dict(zip(names, grads))}


def assert_same(ref: dict[str, Any], got: dict[str, Any], *, exact: bool) -> None:
    tol = {"rtol": 0.0, "atol": 0.0} if exact else TOL
    torch.testing.assert_close(got["loss"], ref["loss"], **tol)
    torch.testing.assert_close(got["logits"], ref["logits"], **tol)
    assert got["grads"].keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        assert got["grads"][name] is not None, name
        torch.testing.assert_close(got["grads"][name], grad, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", [(1, 13), (2, 7)], ids=["packed_1x13", "batch_2x7"])
def test_tiled_equals_untiled(family: str, num_shards: int, shape: tuple[int, int]) -> None:
    # 13 and 7 are prime: every num_shards > 1 gives uneven chunks.
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(1))
    reference = loss_and_grads(model, ids)
    tiled = copy.deepcopy(model)
    names = [n for n, _ in tiled.named_parameters()]
    assert apply_tiled_mlp(tiled, num_shards) == 2
    assert [n for n, _ in tiled.named_parameters()] == names  # nothing renamed or wrapped
    assert_same(reference, loss_and_grads(tiled, ids), exact=num_shards == 1)


def test_torch_autograd_grad_caller_gets_parameter_grads() -> None:
    # Parameter grads are returned from the autograd.Function, not accumulated into .grad
    # behind autograd's back, so torch.autograd.grad sees them (and .grad stays None).
    model = tiny_model("qwen3")
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    reference = loss_and_grads(model, ids, use_autograd_grad=True)
    apply_tiled_mlp(model, 3)
    assert_same(reference, loss_and_grads(model, ids, use_autograd_grad=True), exact=False)
    assert all(p.grad is None for p in model.parameters())


def test_with_activation_checkpointing_of_decoder_layers() -> None:
    # The composable checkpoint API, as shardforge.fsdp_wrap applies it, on top of tiling.
    from torch.distributed._composable import checkpoint

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(3))
    reference = loss_and_grads(model, ids)
    for order in ("tile_then_checkpoint", "checkpoint_then_tile"):
        tiled = copy.deepcopy(model)
        if order == "tile_then_checkpoint":
            apply_tiled_mlp(tiled, 3)
        for layer in tiled.model.layers:
            checkpoint(layer)
        if order == "checkpoint_then_tile":
            apply_tiled_mlp(tiled, 3)
        assert_same(reference, loss_and_grads(tiled, ids), exact=False)


def test_frozen_mlp_weights_and_no_grad_forward() -> None:
    model = tiny_model("qwen3")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    for layer in model.model.layers:
        layer.mlp.up_proj.weight.requires_grad_(False)
    reference = loss_and_grads(model, ids)
    tiled = copy.deepcopy(model)
    apply_tiled_mlp(tiled, 2)
    got = loss_and_grads(tiled, ids)
    assert got["grads"]["model.layers.0.mlp.up_proj.weight"] is None
    ref_grads = {k: v for k, v in reference["grads"].items() if v is not None}
    assert_same(
        {**reference, "grads": ref_grads}, {**got, "grads": {k: got["grads"][k] for k in ref_grads}}, exact=False
    )
    with torch.no_grad():
        torch.testing.assert_close(tiled(input_ids=ids).logits, model(input_ids=ids).logits, **TOL)


def test_reapply_changes_num_shards_without_double_wrapping() -> None:
    model = tiny_model("qwen3")
    assert apply_tiled_mlp(model, 2) == 2
    mlp = model.model.layers[0].mlp
    forward = mlp.forward
    assert apply_tiled_mlp(model, 4) == 2
    assert mlp.forward is forward
    assert mlp._shardforge_tiled_mlp.num_shards == 4
    # A deep copy of a tiled model runs its own modules, not the original's.
    copied = copy.deepcopy(model).model.layers[0].mlp
    assert copied.forward.__self__ is copied
    assert copied._shardforge_tiled_mlp.original_forward.__self__ is copied


def test_moe_blocks_are_skipped_and_dense_layers_tiled() -> None:
    # Qwen3-MoE: layer 0 dense (mlp_only_layers), layer 1 a routed MoE block.
    model = tiny_model("qwen3_moe", mlp_only_layers=[0], decoder_sparse_step=1)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    reference = loss_and_grads(model, ids)
    assert apply_tiled_mlp(model, 3) == 1
    assert hasattr(model.model.layers[0].mlp, "_shardforge_tiled_mlp")
    assert not hasattr(model.model.layers[1].mlp, "_shardforge_tiled_mlp")
    assert_same(reference, loss_and_grads(model, ids), exact=False)


def test_errors_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="num_shards=0 must be an int >= 1"):
        apply_tiled_mlp(tiny_model("qwen3"), 0)
    with pytest.raises(ValueError, match=r"num_shards=2\.0 must be an int >= 1"):
        apply_tiled_mlp(tiny_model("qwen3"), 2.0)  # type: ignore[arg-type]
    all_moe = tiny_model("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=1)
    with pytest.raises(ValueError, match=r"found no dense decoder MLP in Qwen3MoeForCausalLM.*skipped 2 routed MoE"):
        apply_tiled_mlp(all_moe, 2)
    with pytest.raises(ValueError, match="found no dense decoder MLP in Linear"):
        apply_tiled_mlp(torch.nn.Linear(2, 2), 2)
