"""EngineConfig.lora: CLI-style overrides build a LoRAConfig; unsupported combinations are refused."""

from __future__ import annotations

import pytest

from shardforge.algorithms.config_io import apply_overrides, build_config, config_to_dict
from shardforge.engine.checks import check_engine
from shardforge.engine.config import EngineConfig
from shardforge.lora import LoRAConfig
from shardforge.mesh import ParallelDims


def validate_lora(config: EngineConfig, pp: int) -> None:
    from transformers import Qwen3Config

    hf_config = Qwen3Config(
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False
    )
    check_engine(ParallelDims(pp=pp, dp_shard=1), hf_config, config)


def test_lora_overrides_build_a_lora_config() -> None:
    data = apply_overrides({}, ["lora.r=8", "lora.target_modules=[q_proj,v_proj]", "lora.use_rslora=true"])
    config = build_config(EngineConfig, data)
    assert config.lora == LoRAConfig(r=8, target_modules=("q_proj", "v_proj"), use_rslora=True)
    regex = build_config(EngineConfig, apply_overrides({}, [r"lora.target_modules=.*\.(q|v)_proj"]))
    assert regex.lora is not None and regex.lora.target_modules == r".*\.(q|v)_proj"
    assert build_config(EngineConfig, {}).lora is None
    assert build_config(EngineConfig, config_to_dict(config)) == config  # round trip (saved run configs)
    with pytest.raises(ValueError, match="r=0"):
        build_config(EngineConfig, apply_overrides({}, ["lora.r=0"]))
    with pytest.raises(ValueError, match="unknown config key"):
        build_config(EngineConfig, apply_overrides({}, ["lora.rank=8"]))


def test_unsupported_lora_layouts_are_refused() -> None:
    validate_lora(EngineConfig(), pp=2)  # no LoRA: nothing to refuse
    validate_lora(EngineConfig(lora=LoRAConfig()), pp=1)
    with pytest.raises(ValueError, match="pp=2"):
        validate_lora(EngineConfig(lora=LoRAConfig()), pp=2)
    with pytest.raises(ValueError, match="value head"):
        validate_lora(EngineConfig(lora=LoRAConfig(), head="value"), pp=1)


def test_sft_trainer_with_lora_writes_merged_model_and_peft_adapter(tmp_path, monkeypatch) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.sft import SFTConfig, run_sft

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    train = tiny_assets(tmp_path, seed=3, tokenizer_dir="tok", max_operand=20, num_eval=2, data_seed=1)["train"]
    data = {
        "model": str(tmp_path / "model"), "train_file": str(train), "output_dir": str(tmp_path / "out"),
        "layout": "d1", "steps": 3, "global_batch_size": 8, "progress": False,
        "engine": {"optimizer": {"lr": 1e-2}, "max_tokens_per_microbatch": 64},
    }  # fmt: skip
    overrides = ["engine.lora.r=4", "engine.lora.target_modules=[q_proj,v_proj]"]
    summary = run_sft(build_config(SFTConfig, apply_overrides(data, overrides)))
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    merged = AutoModelForCausalLM.from_pretrained(summary["hf_dir"]).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).eval()
    peft_model = PeftModel.from_pretrained(base, summary["lora_dir"]).eval()
    with torch.no_grad():
        via_peft, via_merged = peft_model(input_ids=ids).logits, merged(input_ids=ids).logits
        untrained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).eval()(input_ids=ids).logits
    torch.testing.assert_close(via_merged, via_peft, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(via_merged, untrained, atol=1e-4), "the adapters did not train"
