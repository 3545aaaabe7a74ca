"""FSDP / HSDP parity: a sharded train step equals the unsharded HF model on the same data.

Every rank gets a different slice of one batch; the single-process reference sees the whole
batch. All sequences have the same length, so the reference loss (mean over all tokens) is
the mean of the per-rank losses, and its gradient is the mean of the per-rank gradients,
which is exactly what FSDP's reduce-scatter (and HSDP's all-reduce across replicas) must
produce. A reduction that sums instead of averaging, or skips the replica all-reduce, moves
every gradient by O(100%), far outside the tolerance.

Rank functions are module-level so the rank pool can pickle them.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
SEQ_LEN = 12
SEQS_PER_RANK = 2

# Tolerance for sharded vs unsharded (float32, CPU). The sharded run computes with the same
# full weights (all-gathered), but on a smaller batch (different GEMM blocking) and its
# gradients are a reduce-scatter sum of per-rank gradients divided by the world size instead
# of one backward over the whole batch: a few float32 ulps apart (observed <= 3e-8 absolute
# on gradients of magnitude ~1e-2..1, <= 5e-7 on a loss of ~4.2).
LOSS_TOL = {"rtol": 1e-6, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def tiny_config(arch: str, *, tie: bool = False) -> Any:
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


def build_model(arch: str, *, tie: bool = False, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, tie=tie))


def _mesh(layout: str) -> Any:
    from shardforge.mesh import ParallelDims, build_mesh

    if layout == "hsdp":
        return build_mesh(ParallelDims(dp_replicate=2, dp_shard=2)).get(("dp_replicate", "fsdp"))
    return build_mesh(ParallelDims(dp_shard=dist.get_world_size())).get("fsdp")


# ---------------------------------------------------------------------------------------------- rank functions
def _sharded_step(
    arch: str,
    tie: bool,
    layout: str,
    fsdp_kwargs: dict[str, Any],
    state: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from shardforge.fsdp_wrap import FSDPConfig, apply_fsdp, load_full_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh(layout)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(arch, tie=tie))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_fsdp(model, mesh, FSDPConfig(**fsdp_kwargs))
    load_full_state_dict(model, state if rank == 0 else None, device="cpu", buffers=buffers if rank == 0 else None)

    chunk = input_ids.chunk(world)[rank]  # a different slice of the batch on every rank
    out = model(input_ids=chunk, labels=chunk)
    # Between forward and backward: which parameters are still gathered (plain tensors)?
    gathered_after_forward = {
        "layer0": not isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor),
        "embed": not isinstance(model.model.embed_tokens.weight, DTensor),
    }
    out.loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    result = {
        "loss": out.loss.detach(),
        "chunk": chunk,
        "grads": grads,
        "units": sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule)),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "gathered_after_forward": gathered_after_forward,
        "warnings": [str(w.message) for w in caught],
        "layers_share_a_unit": model.model.layers[0]._get_fsdp_state() is model.model.layers[1]._get_fsdp_state(),
        "mesh_shape": tuple(mesh.shape),
    }
    return result


# ---------------------------------------------------------------------------------------------- helpers
def _reference(arch: str, tie: bool, world: int) -> tuple[torch.nn.Module, torch.Tensor, dict[str, Any]]:
    model = build_model(arch, tie=tie)
    state = copy.deepcopy(model.state_dict())
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    torch.manual_seed(1234)
    input_ids = torch.randint(0, VOCAB, (world * SEQS_PER_RANK, SEQ_LEN))
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    ref = {
        "loss": out.loss.detach(),
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "state": state,
        "buffers": buffers,
    }
    return model, input_ids, ref


def _run_and_compare(
    arch: str, layout: str, world: int, *, tie: bool = False, fsdp_kwargs: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    model, input_ids, ref = _reference(arch, tie, world)
    results = get_rank_pool(world).run(
        _sharded_step, arch, tie, layout, fsdp_kwargs or {}, ref["state"], ref["buffers"], input_ids
    )
    # Each rank saw its own data, and its local loss is the reference model's loss on that slice.
    chunks = [r["chunk"] for r in results]
    assert all(not torch.equal(chunks[0], c) for c in chunks[1:])
    torch.testing.assert_close(torch.cat(chunks), input_ids, rtol=0, atol=0)
    with torch.no_grad():
        for r in results:
            torch.testing.assert_close(r["loss"], model(input_ids=r["chunk"], labels=r["chunk"]).loss, **LOSS_TOL)
    torch.testing.assert_close(torch.stack([r["loss"] for r in results]).mean(), ref["loss"], **LOSS_TOL)
    # Every parameter's gradient, gathered on every rank, equals the unsharded model's.
    for rank, r in enumerate(results):
        assert set(r["grads"]) == set(ref["grads"]), f"rank {rank}: parameter names differ"
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], grad, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
    return results


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize(
    ("layout", "world", "mesh_shape"),
    [("fsdp", 2, (2,)), ("fsdp", 4, (4,)), ("hsdp", 4, (2, 2))],
    ids=["fsdp2", "fsdp4", "hsdp2x2"],
)
def test_sharded_loss_and_grads_match_unsharded(arch: str, layout: str, world: int, mesh_shape: tuple) -> None:
    results = _run_and_compare(arch, layout, world)
    for r in results:
        assert r["mesh_shape"] == mesh_shape
        # One unit per decoder layer, plus embedding, lm_head and the root.
        assert r["units"] == ["", "lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1"]
        assert r["warnings"] == []
        # reshard_after_forward=True (default): non-final layers and the embedding are freed after forward.
        assert r["gathered_after_forward"] == {"layer0": False, "embed": False}


@pytest.mark.parametrize(("layout", "world"), [("fsdp", 2), ("hsdp", 4)], ids=["fsdp2", "hsdp2x2"])
def test_no_reshard_after_forward_keeps_params_gathered_and_matches(layout: str, world: int) -> None:
    results = _run_and_compare("qwen3", layout, world, fsdp_kwargs={"reshard_after_forward": False})
    for r in results:
        assert r["gathered_after_forward"] == {"layer0": True, "embed": True}


@pytest.mark.parametrize(
    ("layout", "world"), [("fsdp", 2), ("fsdp", 4), ("hsdp", 4)], ids=["fsdp2", "fsdp4", "hsdp2x2"]
)
def test_tied_embeddings_stay_tied_and_match(layout: str, world: int) -> None:
    results = _run_and_compare("qwen3", layout, world, tie=True)
    for r in results:
        assert r["tied"], "lm_head.weight is no longer embed_tokens.weight after apply_fsdp + load"
        assert "lm_head.weight" not in r["grads"]  # one parameter, one gradient
        # Tied weights stay in the root unit (both would otherwise be sharded separately).
        assert r["units"] == ["", "model.layers.0", "model.layers.1"]
        assert len(r["warnings"]) == 2
        assert all("tied" in w and "root FSDP unit" in w for w in r["warnings"])


@pytest.mark.parametrize(
    ("fsdp_kwargs", "shared", "layer0_gathered"),
    [
        ({"layers_per_unit": 2}, True, True),  # one unit of both layers: the last unit, kept gathered
        ({"forward_prefetch": 1}, False, False),
        ({"layers_per_unit": 2, "forward_prefetch": 1}, True, True),
    ],
    ids=["two-layers-per-unit", "prefetch1", "both"],
)
def test_unit_size_and_prefetch_change_no_numbers(
    fsdp_kwargs: dict[str, Any], shared: bool, layer0_gathered: bool
) -> None:
    results = _run_and_compare("qwen3", "fsdp", 2, fsdp_kwargs=fsdp_kwargs)
    for r in results:
        assert r["layers_share_a_unit"] is shared
        assert r["gathered_after_forward"]["layer0"] is layer0_gathered


def test_bad_unit_settings_are_refused() -> None:
    from shardforge.fsdp_wrap import FSDPConfig

    with pytest.raises(ValueError, match="layers_per_unit=0 must be >= 1"):
        FSDPConfig(layers_per_unit=0)
