"""`validate_tp` / `valid_tp_sizes` and plan lookup: pure config checks, no process group.

`apply_tensor_parallel` runs `validate_tp` before `parallelize_module`, i.e. before any
collective; that ordering is exercised on real ranks in test_tp_parity.py
(`test_indivisible_heads_fail_before_sharding`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from shardforge.tensor_parallel import (
    PLAN_BUILDERS,
    dense_decoder_plan,
    moe_attention_plan,
    plan_for_model,
    supported_families,
    valid_tp_sizes,
    validate_tp,
)


def config(**overrides: Any) -> Any:
    from transformers import Qwen3Config

    kwargs: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
    }
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def moe_config(**overrides: Any) -> Any:
    from transformers import Qwen3MoeConfig

    kwargs: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 63,  # odd on purpose: the dense-MLP width is unused by TP here
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


# ---------------------------------------------------------------------------------------------- valid sizes
def test_valid_tp_sizes_of_the_tiny_model() -> None:
    assert valid_tp_sizes(config()) == [1, 2, 4]


def test_valid_tp_sizes_limited_by_kv_heads() -> None:
    assert valid_tp_sizes(config(num_attention_heads=8, num_key_value_heads=2)) == [1, 2]


def test_valid_tp_sizes_odd_vocab() -> None:
    # 63 = 3^2 * 7: no even tp; 3 also divides nothing else here, so only tp=1 remains.
    assert valid_tp_sizes(config(vocab_size=63)) == [1]
    assert valid_tp_sizes(
        config(vocab_size=63, num_attention_heads=3, num_key_value_heads=3, intermediate_size=63)
    ) == [
        1,
        3,
    ]


def test_valid_tp_sizes_of_a_larger_model() -> None:
    big = config(
        vocab_size=151936, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, hidden_size=1024
    )
    assert valid_tp_sizes(big) == [1, 2, 4, 8]


# ---------------------------------------------------------------------------------------------- errors
def test_kv_heads_error_names_dim_and_valid_values() -> None:
    cfg = config(num_attention_heads=4, num_key_value_heads=2)
    validate_tp(cfg, 2)  # fine
    with pytest.raises(ValueError) as err:
        validate_tp(cfg, 4)
    message = str(err.value)
    assert "tp=4" in message
    assert "num_key_value_heads=2" in message
    assert "valid tp for this model: [1, 2]" in message


def test_attention_heads_error() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads=6.*valid tp for this model: \[1, 2\]"):
        validate_tp(config(num_attention_heads=6, num_key_value_heads=2), 4)


def test_odd_vocab_only_allows_odd_divisors() -> None:
    # Heads and intermediate divide 2 and 4; only the vocab rules them out.
    cfg = config(vocab_size=63, num_attention_heads=12, num_key_value_heads=12, intermediate_size=252)
    for tp in (2, 4):
        with pytest.raises(ValueError, match=r"vocab_size=63.*valid tp for this model: \[1, 3\]"):
            validate_tp(cfg, tp)
    validate_tp(cfg, 3)


def test_intermediate_size_error() -> None:
    cfg = config(intermediate_size=66)
    with pytest.raises(ValueError, match=r"tp=4 must divide intermediate_size=66.*valid tp for this model: \[1, 2\]"):
        validate_tp(cfg, 4)


@pytest.mark.parametrize("tp", [0, -2])
def test_non_positive_tp(tp: int) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        validate_tp(config(), tp)


def test_tp_one_always_valid() -> None:
    validate_tp(config(vocab_size=61, intermediate_size=61), 1)


def test_moe_ignores_intermediate_size() -> None:
    cfg = moe_config()
    validate_tp(cfg, 2)
    validate_tp(cfg, 4)
    assert valid_tp_sizes(cfg) == [1, 2, 4]
    # The same odd width on a dense model is a real constraint.
    with pytest.raises(ValueError, match="intermediate_size=63"):
        validate_tp(config(intermediate_size=63), 2)


def test_moe_still_checks_heads_and_vocab() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        validate_tp(moe_config(num_key_value_heads=2), 4)
    with pytest.raises(ValueError, match="vocab_size=66"):
        validate_tp(moe_config(vocab_size=66), 4)


def test_duck_typed_config() -> None:
    # Any object with the HF attribute names works; missing kv heads default to the heads.
    cfg = SimpleNamespace(num_attention_heads=8, vocab_size=64, intermediate_size=36)
    assert valid_tp_sizes(cfg) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"intermediate_size=36.*\[1, 2, 4\]"):
        validate_tp(cfg, 8)


# ---------------------------------------------------------------------------------------------- plan lookup
def test_supported_families() -> None:
    assert supported_families() == ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]
    assert set(PLAN_BUILDERS) == set(supported_families())


def test_unknown_family_error_without_a_model_config() -> None:
    with pytest.raises(ValueError) as err:
        plan_for_model(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))  # type: ignore[arg-type]
    message = str(err.value)
    assert "model_type='gpt2'" in message and "plan=" in message
    assert str(supported_families()) in message
    # The suggested call is balanced Python (a regression printed "...}})").
    assert message.endswith("plan={'model.layers.*.self_attn.q_proj': ColwiseParallel(), ...})"), message


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
def test_plan_tables(sequence_parallel: bool) -> None:
    plan = dense_decoder_plan(sequence_parallel=sequence_parallel, qk_norm=True)
    assert all(isinstance(style, ParallelStyle) for style in plan.values())
    layer = "model.layers.*"
    for name in ("q_proj", "k_proj", "v_proj"):
        assert type(plan[f"{layer}.self_attn.{name}"]) is ColwiseParallel
    for name in ("gate_proj", "up_proj"):
        assert type(plan[f"{layer}.mlp.{name}"]) is ColwiseParallel
    assert type(plan[f"{layer}.self_attn.o_proj"]) is RowwiseParallel
    assert type(plan[f"{layer}.mlp.down_proj"]) is RowwiseParallel
    assert type(plan["model.embed_tokens"]) is RowwiseParallel
    assert type(plan["lm_head"]) is ColwiseParallel
    assert type(plan[f"{layer}.self_attn.q_norm"]) is SequenceParallel
    norms = {f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm", "model.norm"}
    if sequence_parallel:
        assert all(type(plan[n]) is SequenceParallel for n in norms)
    else:
        assert not norms & set(plan)
    # Without q/k norms (Llama-style) those entries are absent.
    assert f"{layer}.self_attn.q_norm" not in dense_decoder_plan(sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
def test_moe_plan_leaves_experts_alone(sequence_parallel: bool) -> None:
    plan = moe_attention_plan(sequence_parallel=sequence_parallel)
    assert not [k for k in plan if ".mlp." in k], "MoE experts/router must not be tensor-parallel"
    assert ("model.layers.*.mlp" in plan) == sequence_parallel
    assert "model.layers.*.self_attn.q_norm" in plan
