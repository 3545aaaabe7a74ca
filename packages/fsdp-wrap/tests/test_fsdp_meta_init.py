"""Meta-device init: `load_full_state_dict` reproduces a normal load bit for bit.

A "normal load" is the model built on CPU from the same seed; its state dict and buffers are
the reference. After meta init + `apply_fsdp` + `load_full_state_dict`, gathering every
parameter (`.full_tensor()`) and every buffer (rotary ``inv_freq``, which no state dict
carries) must give exactly the same values: loading copies, it computes nothing, so the
comparison is exact (`torch.equal`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.fsdp_wrap import load_full_state_dict
from shardforge.mesh.testing import get_rank_pool

VOCAB = 64


def tiny_config(arch: str = "qwen3", *, tie: bool = False) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    return cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def build_model(arch: str = "qwen3", *, tie: bool = False, seed: int = 0, meta: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(tiny_config(arch, tie=tie))
    return AutoModelForCausalLM.from_config(tiny_config(arch, tie=tie))


def _reference(arch: str = "qwen3", *, tie: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    ref = build_model(arch, tie=tie)
    return copy.deepcopy(ref.state_dict()), {name: b.clone() for name, b in ref.named_buffers()}


def _assert_same(model_params: dict, model_buffers: dict, state: dict, buffers: dict) -> None:
    assert set(model_params) <= set(state)
    for name, value in model_params.items():
        assert torch.equal(value, state[name]), f"parameter {name} differs from the normal load"
    assert set(model_buffers) == set(buffers) and model_buffers
    for name, value in model_buffers.items():
        assert torch.equal(value, buffers[name]), f"buffer {name} differs from the normal load"


# ---------------------------------------------------------------------------------------------- rank functions
def _sharded_load(
    arch: str,
    tie: bool,
    layout: str,
    meta: bool,
    state: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from shardforge.fsdp_wrap import apply_fsdp
    from shardforge.mesh import ParallelDims, build_mesh

    rank = dist.get_rank()
    if layout == "hsdp":
        mesh = build_mesh(ParallelDims(dp_replicate=2, dp_shard=2)).get(("dp_replicate", "fsdp"))
    else:
        mesh = build_mesh(ParallelDims(dp_shard=dist.get_world_size())).get("fsdp")
    # meta=False: an already materialised model with *different* weights (seed 7) is overwritten.
    model = build_model(arch, tie=tie, seed=7, meta=meta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied-embedding warning is tested in test_fsdp_parity.py
        apply_fsdp(model, mesh)
    load_full_state_dict(model, state if rank == 0 else None, device="cpu", buffers=buffers if rank == 0 else None)
    return {
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "local_numel": sum(p.to_local().numel() for p in model.parameters()),
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "no_meta": not any(t.is_meta for t in [*model.parameters(), *model.buffers()]),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def _bad_load(case: str, state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> str:
    """Call load_full_state_dict wrongly on rank 0 (correctly elsewhere); return the error text."""
    from shardforge.fsdp_wrap import apply_fsdp
    from shardforge.mesh import ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims(dp_shard=dist.get_world_size())).get("fsdp")
    model = build_model(meta=True)
    apply_fsdp(model, mesh)
    if dist.get_rank() == 0:
        if case == "no_state":
            state = None  # type: ignore[assignment]
        elif case == "no_buffers":
            buffers = None  # type: ignore[assignment]
        else:
            buffers = {n: b for n, b in buffers.items() if not n.endswith("inv_freq")}
    else:
        state, buffers = None, None  # type: ignore[assignment]
    try:
        load_full_state_dict(model, state, device="cpu", buffers=buffers)
    except ValueError as exc:  # caught here so the shared pool is not restarted
        return str(exc)
    return "no error"


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    ("arch", "tie", "layout", "world", "meta"),
    [
        ("qwen3", False, "fsdp", 2, True),
        ("llama", False, "fsdp", 2, True),
        ("qwen3", True, "fsdp", 2, True),
        ("qwen3", False, "hsdp", 4, True),
        ("qwen3", False, "fsdp", 2, False),
    ],
    ids=["qwen3-fsdp2", "llama-fsdp2", "qwen3-tied-fsdp2", "qwen3-hsdp2x2", "qwen3-fsdp2-materialised"],
)
def test_sharded_load_equals_normal_load(arch: str, tie: bool, layout: str, world: int, meta: bool) -> None:
    state, buffers = _reference(arch, tie=tie)
    assert any(name.endswith("inv_freq") for name in buffers)
    assert not any(name.endswith("inv_freq") for name in state)  # only the buffer path can load it
    results = get_rank_pool(world).run(_sharded_load, arch, tie, layout, meta, state, buffers)
    full_numel = sum(p.numel() for p in build_model(arch, tie=tie).parameters())
    for r in results:
        assert r["no_meta"] and r["all_dtensor"]
        assert r["tied"] == tie
        # Each rank holds only a shard (ceil-sized, so at most the full model / shard count + padding).
        assert r["local_numel"] < full_numel
        _assert_same(r["params"], r["buffers"], state, buffers)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_meta_load_without_process_group(tie: bool) -> None:
    """Not distributed, not sharded: the meta path alone (to_empty + re-tie + load + buffers)."""
    assert not dist.is_initialized()
    state, buffers = _reference(tie=tie)
    model = build_model(tie=tie, meta=True)
    load_full_state_dict(model, state, device="cpu", buffers=buffers)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    _assert_same(dict(model.named_parameters()), dict(model.named_buffers()), state, buffers)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no_state", "rank 0 must pass the full state dict"),
        ("no_buffers", "buffers=None"),
        ("missing_buffer", "reference buffers are missing .*inv_freq"),
    ],
)
def test_bad_call_raises_without_process_group(case: str, match: str) -> None:
    state, buffers = _reference()
    model = build_model(meta=True)
    kwargs: dict[str, Any] = {"device": "cpu", "buffers": buffers}
    if case == "no_state":
        state = None  # type: ignore[assignment]
    elif case == "no_buffers":
        kwargs["buffers"] = None
    else:
        kwargs["buffers"] = {n: b for n, b in buffers.items() if not n.endswith("inv_freq")}
    with pytest.raises(ValueError, match=match):
        load_full_state_dict(model, state, **kwargs)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no_state", "rank 0 must pass the full state dict"),
        ("no_buffers", "buffers=None"),
        ("missing_buffer", "reference buffers are missing"),
    ],
)
def test_bad_call_on_rank0_raises_on_every_rank(case: str, match: str) -> None:
    """Rank 0's mistake must surface on all ranks, not leave rank 1 blocked in a broadcast."""
    state, buffers = _reference()
    errors = get_rank_pool(2).run(_bad_load, case, state, buffers, timeout_s=60)
    assert len(errors) == 2
    for error in errors:
        assert match in error, error
