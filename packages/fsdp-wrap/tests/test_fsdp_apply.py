"""`apply_fsdp` structure and validation, on torch's fake process-group backend (no processes).

`fully_shard` on a meta-device model does no communication, so which modules become FSDP
units, on which mesh, with which policies, can be checked in this process for world sizes
that are never spawned. Numerics are covered by test_fsdp_parity.py. The policy checks
read FSDP2's (private) per-module state, the only place these settings are visible.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from shardforge.fsdp_wrap import FSDPConfig, apply_fsdp
from shardforge.mesh import ParallelDims
from shardforge.mesh.testing import fake_mesh

DEFAULT_UNITS = ["", "lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1"]


def tiny_config(*, tie: bool = False) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def meta_model(*, tie: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(tie=tie))


def units(model: torch.nn.Module) -> list[str]:
    return sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule))


def param_group(module: torch.nn.Module) -> Any:
    return module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]


def test_three_dim_mesh_raises_and_leaves_model_alone() -> None:
    with fake_mesh(ParallelDims(dp_replicate=2, dp_shard=2, tp=2), world_size=8) as mesh:
        assert mesh.world.ndim == 3
        model = meta_model()
        with pytest.raises(ValueError, match=r"1-D \(shard\) or 2-D \(replicate, shard\) mesh, got 3-D"):
            apply_fsdp(model, mesh.world)
        assert units(model) == []


def test_default_units_and_policies_on_1d_mesh() -> None:
    with fake_mesh(ParallelDims(dp_shard=4), world_size=4, rank=1) as mesh:
        model = apply_fsdp(meta_model(), mesh.get("fsdp"))
        assert units(model) == DEFAULT_UNITS
        group = param_group(model.model.layers[0])
        assert group.mp_policy.param_dtype is None and group.mp_policy.reduce_dtype == torch.float32
        assert not isinstance(group.offload_policy, CPUOffloadPolicy)
        weight = model.model.layers[0].mlp.up_proj.weight
        assert weight.device_mesh.ndim == 1 and weight.to_local().shape == (64 // 4, 32)


def test_hsdp_shards_within_rows_and_replicates_across() -> None:
    from torch.distributed.tensor import Replicate, Shard

    with fake_mesh(ParallelDims(dp_replicate=2, dp_shard=2), world_size=4) as mesh:
        model = apply_fsdp(meta_model(), mesh.get(("dp_replicate", "fsdp")))
        assert units(model) == DEFAULT_UNITS
        weight = model.model.layers[0].mlp.up_proj.weight
        assert tuple(weight.placements) == (Replicate(), Shard(0))
        assert weight.to_local().shape == (64 // 2, 32)


def test_config_fields_reach_fully_shard() -> None:
    config = FSDPConfig(
        param_dtype=torch.bfloat16,
        reduce_dtype=None,
        cpu_offload=True,
        wrap_classes=("Qwen3MLP",),
        wrap_embeddings=False,
        wrap_lm_head=False,
    )
    with fake_mesh(ParallelDims(dp_shard=2), world_size=2) as mesh:
        model = apply_fsdp(meta_model(), mesh.get("fsdp"), config)
        assert units(model) == ["", "model.layers.0.mlp", "model.layers.1.mlp"]
        for module in (model, model.model.layers[0].mlp):
            group = param_group(module)
            assert group.mp_policy.param_dtype == torch.bfloat16 and group.mp_policy.reduce_dtype is None
            assert isinstance(group.offload_policy, CPUOffloadPolicy)
            # Pinning needs an accelerator: on a CPU-only machine it would raise at the first load.
            assert group.offload_policy.pin_memory == torch.accelerator.is_available()


def test_reshard_after_forward_setting() -> None:
    # Layers reshard after forward except the last (its params are needed first in backward);
    # lm_head never does; with reshard_after_forward=False nothing does.
    for reshard, expected in [(True, [True, False, True, False]), (False, [False, False, False, False])]:
        with fake_mesh(ParallelDims(dp_shard=2), world_size=2) as mesh:
            model = apply_fsdp(meta_model(), mesh.get("fsdp"), FSDPConfig(reshard_after_forward=reshard))
            modules = [model.model.layers[0], model.model.layers[1], model.model.embed_tokens, model.lm_head]
            got = [param_group(m).post_forward_mesh_info is not None for m in modules]
            assert got == expected, (reshard, got)


def test_tied_embeddings_stay_in_root_with_clear_warning() -> None:
    with fake_mesh(ParallelDims(dp_shard=2), world_size=2) as mesh:
        model = meta_model(tie=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_fsdp(model, mesh.get("fsdp"))
        assert units(model) == ["", "model.layers.0", "model.layers.1"]
        assert model.lm_head.weight is model.model.embed_tokens.weight
        messages = [str(w.message) for w in caught]
        assert len(messages) == 2
        assert any(m.endswith("the input embedding stays in the root FSDP unit so the tie is kept") for m in messages)
        assert any("lm_head stays in the root FSDP unit" in m for m in messages)


@pytest.mark.parametrize(
    ("make_model", "config", "match"),
    [
        (
            lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)),
            None,
            r"Sequential has no `_no_split_modules`.*wrap_classes",
        ),
        (meta_model, FSDPConfig(wrap_classes=("NoSuchLayer",)), r"NoSuchLayer.*Qwen3DecoderLayer"),
    ],
    ids=["no-split-modules", "unknown-class"],
)
def test_policy_errors(make_model: Any, config: FSDPConfig | None, match: str) -> None:
    with fake_mesh(ParallelDims(dp_shard=2), world_size=2) as mesh:
        model = make_model()
        with pytest.raises(ValueError, match=match):
            apply_fsdp(model, mesh.get("fsdp"), config)
        assert units(model) == []


def test_keep_input_dtype_classes_get_their_own_units_without_input_casting() -> None:
    # Attention and MLP blocks alternate in module order (attn 0, mlp 0, attn 1, mlp 1). Two per unit
    # would pair each attention with its MLP; keeping the MLPs' input dtype splits them, as a VLM's vision
    # blocks are kept apart from its decoder layers: one mixed-precision policy per unit.
    def config(keep: tuple[str, ...]) -> FSDPConfig:
        return FSDPConfig(
            param_dtype=torch.bfloat16, wrap_classes=("Qwen3Attention", "Qwen3MLP"), keep_input_dtype_classes=keep,
            layers_per_unit=2, wrap_embeddings=False, wrap_lm_head=False,
        )  # fmt: skip

    with fake_mesh(ParallelDims(dp_shard=2), world_size=2) as mesh:
        paired = apply_fsdp(meta_model(), mesh.get("fsdp"), config(())).model.layers
        assert all(param_group(paired[i].self_attn) is param_group(paired[i].mlp) for i in (0, 1))
        model = apply_fsdp(meta_model(), mesh.get("fsdp"), config(("Qwen3MLP",)))
        layers = model.model.layers
        for i in (0, 1):
            assert param_group(layers[i].self_attn) is not param_group(layers[i].mlp)
            assert param_group(layers[i].self_attn).mp_policy.cast_forward_inputs
            policy = param_group(layers[i].mlp).mp_policy
            assert not policy.cast_forward_inputs and policy.param_dtype == torch.bfloat16
        assert param_group(model).mp_policy.cast_forward_inputs
