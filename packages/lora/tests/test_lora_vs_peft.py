"""LoRA parity against PEFT (the reference implementation) on one process.

Both sides start from the same tiny HF model (same base weights) and the same adapter values: ours are
initialised with init="random" (B non-zero, so the adapter changes the logits and A gets gradients at
step 0) and copied into PEFT's ``get_peft_model`` copy. Compared: logits, loss, adapter gradients, and
adapters after a few AdamW steps; our PEFT-format export loaded by ``PeftModel.from_pretrained``; our
merged state dict vs PEFT's ``merge_and_unload()``.

Tolerances: both sides run the same fp32 operations in the same order (base + B(A(x)) * scaling; the
merge as (B @ A) * scaling added to W), so forward, loss, grads and merges are exact; after AdamW steps
we allow 1e-6 in case the optimizer's step path differs (observed 0.0).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from shardforge.lora import (
    PEFT_PREFIX,
    LoRAConfig,
    apply_lora,
    lora_modules,
    lora_state_dict,
    merge_lora,
    merged_lora,
    merged_state_dict,
    save_peft_adapter,
)

VOCAB = 96
STEP_TOL = {"rtol": 1e-6, "atol": 1e-6}


def tiny_model(family: str, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    config = Qwen3Config(head_dim=8, **common) if family == "qwen3" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    return ids, ids.clone()


def peft_twin(base: Any, ours: Any, config: LoRAConfig) -> Any:
    """PEFT's LoRA on a copy of the base model, with our adapter values copied in."""
    from peft import LoraConfig, get_peft_model

    peft_config = LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=config.target_modules if isinstance(config.target_modules, str) else list(config.target_modules),
        use_rslora=config.use_rslora,
        bias="none",
    )
    twin = get_peft_model(copy.deepcopy(base), peft_config)
    ours_sd = lora_state_dict(ours)
    with torch.no_grad():
        for name, module in twin.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                key = name.removeprefix(PEFT_PREFIX)
                module.lora_A["default"].weight.copy_(ours_sd[f"{key}.lora_A.weight"])
                module.lora_B["default"].weight.copy_(ours_sd[f"{key}.lora_B.weight"])
    return twin


def adapter_grads_peft(twin: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in twin.named_parameters():
        if p.requires_grad:
            key = name.removeprefix(PEFT_PREFIX).replace(".default.", ".")
            out[key] = p.grad.clone()
    return out


@pytest.mark.parametrize(
    ("family", "targets", "rslora"),
    [
        ("qwen3", ("q_proj", "v_proj", "o_proj", "down_proj"), False),
        ("llama", r".*\.(k_proj|up_proj|gate_proj)", True),
    ],
)
def test_forward_grads_steps_match_peft(family: str, targets: Any, rslora: bool) -> None:
    config = LoRAConfig(r=4, alpha=8, target_modules=targets, use_rslora=rslora, init="random")
    base = tiny_model(family)
    ours = copy.deepcopy(base)
    names = apply_lora(ours, config, seed=3)
    assert len(names) == 2 * (len(targets) if isinstance(targets, tuple) else 3)
    twin = peft_twin(base, ours, config)

    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.{k}.weight" for m in names for k in ("lora_A", "lora_B")}
    twin_trainable = {
        n.removeprefix(PEFT_PREFIX).replace(".default.", ".") for n, p in twin.named_parameters() if p.requires_grad
    }
    assert trainable == twin_trainable
    # Base names unchanged: our state dict is the HF one plus adapter keys.
    assert set(ours.state_dict()) - trainable == set(base.state_dict())

    opt_ours = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    opt_peft = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    for step in range(3):
        ids, labels = batch(step)
        out_ours, out_peft = ours(input_ids=ids, labels=labels), twin(input_ids=ids, labels=labels)
        torch.testing.assert_close(out_ours.logits, out_peft.logits, rtol=0, atol=0)
        torch.testing.assert_close(out_ours.loss, out_peft.loss, rtol=0, atol=0)
        out_ours.loss.backward()
        out_peft.loss.backward()
        grads_ours = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
        grads_peft = adapter_grads_peft(twin)
        assert grads_ours.keys() == grads_peft.keys()
        for name in grads_ours:
            torch.testing.assert_close(grads_ours[name], grads_peft[name], rtol=0, atol=0, msg=name)
            assert grads_ours[name].abs().sum() > 0, name  # B != 0: every adapter gets a gradient
        opt_ours.step()
        opt_peft.step()
        opt_ours.zero_grad()
        opt_peft.zero_grad()
    peft_sd = {
        n.removeprefix(PEFT_PREFIX).replace(".default.", "."): p for n, p in twin.named_parameters() if p.requires_grad
    }
    for name, value in lora_state_dict(ours).items():
        torch.testing.assert_close(value, peft_sd[name].detach(), **STEP_TOL, msg=name)
    # Base weights never moved.
    for name, value in base.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, rtol=0, atol=0)

    # Merged export == PEFT merge_and_unload, and it is a plain HF state dict that reproduces the logits.
    merged = merged_state_dict(ours)
    assert set(merged) == set(base.state_dict())
    unloaded = twin.merge_and_unload().state_dict()
    for name, value in merged.items():
        torch.testing.assert_close(value, unloaded[name], rtol=0, atol=0, msg=name)
    ids, _ = batch(9)
    with torch.no_grad():
        expected = ours(input_ids=ids).logits
        plain = copy.deepcopy(base)
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        with merged_lora(ours):  # in place, hidden adapters; restored exactly afterwards
            assert not any("lora_" in k for k in ours.state_dict())
            torch.testing.assert_close(ours(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours(input_ids=ids).logits, expected, rtol=0, atol=0)
        merge_lora(ours)
        assert not lora_modules(ours) and set(ours.state_dict()) == set(base.state_dict())
        torch.testing.assert_close(ours(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_peft_export_loads_in_peft(tmp_path: Any) -> None:
    from peft import PeftModel

    config = LoRAConfig(r=4, alpha=4, target_modules=("q_proj", "k_proj", "gate_proj"), init="random")
    base = tiny_model("qwen3")
    ours = copy.deepcopy(base)
    apply_lora(ours, config, seed=0)
    save_peft_adapter(ours, tmp_path / "adapter", config, base_model_name_or_path="tiny-qwen3")
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).eval()
    ids, _ = batch(4)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=0, atol=0)
        assert not torch.equal(base(input_ids=ids).logits, ours(input_ids=ids).logits)  # the adapter acts


def test_adapter_records_the_configured_base_model(tmp_path: Any) -> None:
    """``LoRAConfig.base_model_name_or_path`` (a hub id for a model trained from a local copy) is what the
    adapter names as its base; an explicit argument still wins (the trainer's resolved local path)."""
    import json

    config = LoRAConfig(r=2, target_modules=("q_proj",), base_model_name_or_path="Qwen/Qwen3-0.6B")
    model = tiny_model("qwen3")
    apply_lora(model, config, seed=0)
    save_peft_adapter(model, tmp_path / "a", config)
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "Qwen/Qwen3-0.6B"
    )
    save_peft_adapter(model, tmp_path / "b", config, base_model_name_or_path="/models/qwen3")
    assert json.loads((tmp_path / "b" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "/models/qwen3"
    )


def test_default_init_is_peft_init() -> None:
    config = LoRAConfig(r=8, target_modules=("q_proj",))
    model = tiny_model("llama")
    apply_lora(model, config, seed=5)
    (_, module), *_ = lora_modules(model)
    assert torch.count_nonzero(module.lora_B.weight) == 0  # B = 0: the adapter starts as a no-op
    bound = 1.0 / module.in_features**0.5  # kaiming_uniform(a=sqrt(5)) on [r, in]: U(-1/sqrt(in), 1/sqrt(in))
    assert module.lora_A.weight.abs().max() <= bound and module.lora_A.weight.std() > bound / 3
    assert module.lora_scaling == 16.0 / 8
    again = tiny_model("llama")
    apply_lora(again, config, seed=5)
    torch.testing.assert_close(lora_state_dict(again), lora_state_dict(model), rtol=0, atol=0)  # seeded
    assert LoRAConfig(r=16, alpha=8, use_rslora=True).scaling == 2.0


def test_meta_model_gets_adapters_from_a_state_dict() -> None:
    config = LoRAConfig(r=2, target_modules=("v_proj",))
    reference = tiny_model("qwen3")
    apply_lora(reference, config, seed=1)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        meta = AutoModelForCausalLM.from_config(reference.config, attn_implementation="eager")
    apply_lora(meta, config, seed=1)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.load_state_dict(reference.state_dict())
    torch.testing.assert_close(lora_state_dict(meta), lora_state_dict(reference), rtol=0, atol=0)


def test_bad_configs_raise() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"match no nn.Linear.*'q_proj'"):
        apply_lora(model, LoRAConfig(target_modules=("query", "value")))
    with pytest.raises(ValueError, match=r"not nn\.Linear"):
        apply_lora(model, LoRAConfig(target_modules=("mlp",)))
    with pytest.raises(ValueError, match="r=0"):
        LoRAConfig(r=0)
    with pytest.raises(ValueError, match="dropout"):
        LoRAConfig(dropout=1.5)
    with pytest.raises(ValueError, match="regex"):
        LoRAConfig(target_modules="(unclosed")
    with pytest.raises(ValueError, match="init"):
        LoRAConfig(init="xavier")  # type: ignore[arg-type]
    apply_lora(model, LoRAConfig(target_modules=("q_proj",)))
    with pytest.raises(ValueError, match="already have LoRA"):
        apply_lora(model, LoRAConfig(target_modules=("q_proj",)))
