"""The planner's memory model: hand-computed numbers for a small config, and input errors."""

from __future__ import annotations

import pytest

from shardforge.algorithms.plan import PRESETS, PlanOptions, estimate_memory, load_model_config, model_stats
from shardforge.algorithms.plan.options import parse_memory
from shardforge.mesh import ParallelDims

# Qwen3: h=256, I=768, 8 query / 4 kv heads of d=32 (q=256, kv=128), V=4096, 4 layers.
MODEL = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "tie_word_embeddings": False,
}
T = 1024


def _stats():  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    return model_stats(Qwen3Config(**MODEL))


def _opts(**kw: object) -> PlanOptions:
    base: dict[str, object] = {"seq_len": 256, "micro_batch_tokens": T, "param_dtype": "fp32", "attention": "cpu"}
    base.update(kw)
    return PlanOptions(**base)  # type: ignore[arg-type]


def test_world1_fp32_by_hand() -> None:
    est = estimate_memory(_stats(), ParallelDims.parse("d1").resolve(1), _opts())
    h, q, kv, inter, v, d, a = 256, 256, 128, 768, 4096, 32, 4
    norm = 4 * h + a * h + 4 + a * h  # fp32 input, normalised, 1/rms, output (saved by the next matmul)
    qk_norm = (4 + a) * (q + kv) + 4 * (8 + 4)
    attention_cpu = 5 * a * q + 4 * 8 + 16  # gathered q, k, v; out; o_proj input; lse; gather + order index
    mlp = 4 * a * inter
    layer = 2 * norm + qk_norm + attention_cpu + mlp
    # Walking one layer's autograd graph (distinct saved storages, params excluded) gives 26984 B/token,
    # which includes the rope cos/sin (2 a d) that the model shares between layers.
    assert layer == 26984 - 2 * a * d
    per_token = 4 * layer + 2 * a * d + norm + 12 * v  # layers, rope cos/sin, final norm, loss working set
    params = 4 * _stats().num_params
    assert est.phase == "logits"
    assert est.params == params
    assert est.optim == 2 * params
    assert est.grads == 0  # one micro-batch: no gradient exists before the first backward
    assert est.comm == 0  # no FSDP at world 1
    assert est.activations == T * per_token
    assert est.total == 3 * params + T * per_token


def test_lora_saves_only_what_the_adapters_need_by_hand() -> None:
    # LoRA r=8 on all 7 projections, fp32: the base (norm weights, linears, embedding, lm_head) is frozen,
    # so no matmul keeps its input for a weight gradient, and no norm keeps its normalised value.
    all_linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    est = estimate_memory(_stats(), ParallelDims.parse("d1").resolve(1), _opts(lora_rank=8, lora_targets=all_linears))
    h, q, kv, inter, v, d, a, r = 256, 256, 128, 768, 4096, 32, 4, 8
    norm = 4 * h + 4 + a * h  # input, 1/rms, output (saved by the q/k/v or gate/up lora_A)
    qk_norm = 4 * (q + kv) + 4 * (8 + 4)  # q_proj / k_proj outputs and 1/rms; the normalised q, k are not kept
    attention_cpu = 5 * a * q + 4 * 8 + 16  # as without LoRA: o_proj's lora_A keeps the reordered output
    mlp = 4 * a * inter  # gate, act(gate), up (each kept by the other's product), the product (down's lora_A)
    layer = 2 * norm + qk_norm + attention_cpu + mlp + 7 * a * r  # + x @ A of each adapter
    first = layer - (4 * h + 4)  # the embedding output needs no gradient: layer 0's input norm keeps none
    head = 4 * h + 4  # final norm: input and 1/rms (lm_head is frozen and does not keep its input)
    # Measured with shardforge.algorithms.plan.measure on this model: 134656 B/token (at 4096 tokens, I=1024)
    per_token = 3 * layer + first + 2 * a * d + head + 12 * v
    assert est.phase == "logits"
    assert est.activations == T * per_token
    assert est.grads == 0 and est.state["grads"] == est.state["optim"] // 2  # only adapters have gradients


def test_activation_checkpointing_terms() -> None:
    stats, dims = _stats(), ParallelDims.parse("d1").resolve(1)
    h, a, d = 256, 4, 32
    packed = estimate_memory(stats, dims, _opts(activation_checkpointing="full"))
    single = estimate_memory(stats, dims, _opts(activation_checkpointing="full", seq_len=T))
    # Layer inputs + rope, final norm and the loss; + the [T, T] bool mask HF builds for packed sequences,
    # which the checkpointed layers keep (a single sequence per micro-batch gets no mask).
    assert single.phase == packed.phase == "logits"
    assert single.activations == T * (4 * a * h + 2 * a * d + (12 * h + 4) + 12 * 4096)
    assert packed.activations - single.activations == T * T
    # With a small vocabulary the peak is a layer's backward, in its MLP: the recomputed layer (its first
    # norm's fp32 input is the kept layer input), the product freed, the gradients of the product,
    # act(gate) and up, and of the hidden state; plus the weight gradients of what already ran. Here
    # that is layer 0 (the last to run: one kept input, every other gradient). Measured
    # (shardforge.algorithms.plan.measure, this model): 83.65 MiB, 83.63 predicted.
    from transformers import Qwen3Config

    small_vocab = model_stats(Qwen3Config(**{**MODEL, "vocab_size": 512}))
    est = estimate_memory(small_vocab, dims, _opts(activation_checkpointing="full"))
    inter, layer = 768, 26984 - 2 * a * d  # the per-layer count of test_world1_fp32_by_hand
    work = layer - a * h - a * inter + 3 * a * inter + a * h
    assert est.phase == "layer"
    assert est.activations == T * (a * h + 2 * a * d + work) + T * T
    layer_params = sum(p.numel for p in small_vocab.layer_specs[0].params)
    assert est.grads == a * (512 * h + h + 3 * layer_params + inter * h)  # lm_head, norm, layers 1-3, down_proj


def test_fsdp_keeps_lm_head_and_last_layer_gathered_at_the_loss() -> None:
    stats = _stats()
    one = estimate_memory(stats, ParallelDims.parse("d1").resolve(1), _opts())
    two = estimate_memory(stats, ParallelDims.parse("d2").resolve(2), _opts())
    layer = sum(p.numel for p in stats.layer_specs[0].params)
    assert two.comm == 4 * (4096 * 256 + layer + 256)  # lm_head + last layer + final norm, fp32
    assert two.params == one.params // 2
    assert two.activations == one.activations


def test_options_change_the_right_terms() -> None:
    stats = _stats()
    dims = ParallelDims.parse("d2").resolve(2)
    base = estimate_memory(stats, dims, _opts())
    ac = estimate_memory(stats, dims, _opts(activation_checkpointing="full"))
    assert ac.activations < base.activations / 2
    bf16 = estimate_memory(stats, dims, _opts(compute_dtype="bf16"))
    assert bf16.activations < base.activations and bf16.params == base.params
    accum = estimate_memory(stats, dims, _opts(num_microbatches=4))
    assert accum.grads == base.params  # gradients live across micro-batches
    anyp = estimate_memory(stats, dims, _opts(param_dtype="bf16", optimizer="anyprecision_adamw"))
    assert anyp.optim == 3 * anyp.params  # bf16 moments + Kahan buffer: 6 bytes per 2-byte param
    offload = estimate_memory(stats, dims, _opts(cpu_offload=True))
    assert offload.params == offload.optim == 0 and offload.host == base.state["params"] * 4
    lora = estimate_memory(stats, dims, _opts(lora_rank=8))
    assert 0 < lora.state["optim"] < base.optim / 20


def test_memory_parse() -> None:
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("24 GB") == 24 * 10**9
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory(1000) == 1000
    for bad in ("80 parsecs", "lots", "-5GiB", "0GB"):
        with pytest.raises(ValueError, match="memory"):
            parse_memory(bad)


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="llama3-70b"):
        load_model_config("llama9-1t")
    assert load_model_config("llama3-8b").num_hidden_layers == 32


def test_presets_have_the_published_sizes() -> None:
    sizes = {"llama3-8b": 8.03e9, "llama3-70b": 70.55e9, "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.53e9}
    assert set(sizes) == set(PRESETS)
    for name, expected in sizes.items():
        assert model_stats(load_model_config(name)).num_params == pytest.approx(expected, rel=1e-3)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        _opts(optimizer="sgd")
    with pytest.raises(ValueError, match="dtype"):
        _opts(param_dtype="fp8")
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        _opts(micro_batch_tokens=0)
