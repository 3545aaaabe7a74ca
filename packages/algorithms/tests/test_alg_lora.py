"""EngineConfig.lora: CLI-style overrides build a LoRAConfig; unsupported combinations are refused."""

from __future__ import annotations

import pytest

from shardforge.algorithms.config import EngineConfig
from shardforge.algorithms.config_io import apply_overrides, build_config, config_to_dict
from shardforge.algorithms.lora_support import validate_lora
from shardforge.lora import LoRAConfig


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
