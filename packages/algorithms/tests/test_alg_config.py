"""Config dataclasses, `parse_dtype`, YAML loading, overrides and `build_config` validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardforge.algorithms.config_io import apply_overrides, build_config, config_to_dict, load_yaml
from shardforge.algorithms.trainers.sft import SFTConfig
from shardforge.engine import EngineConfig, OptimizerConfig, SchedulerConfig, parse_dtype

REQUIRED = {"model": "m", "train_file": "t.jsonl", "output_dir": "out"}


# ------------------------------------------------------------------------------------------ parse_dtype
@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        (torch.float16, torch.float16),
    ],
)
def test_parse_dtype(name, dtype):
    assert parse_dtype(name) is dtype


def test_parse_dtype_unknown_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; valid: \['bf16', 'bfloat16'"):
        parse_dtype("int8")


# ------------------------------------------------------------------------------------------ dataclasses
def test_configs_are_frozen_and_keyword_only():
    config = OptimizerConfig(lr=1e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        OptimizerConfig(1e-3)  # type: ignore[misc]


def test_engine_config_defaults():
    config = EngineConfig()
    assert config.optimizer == OptimizerConfig()
    assert config.scheduler == SchedulerConfig(kind="constant")
    assert (config.param_dtype, config.compute_dtype, config.max_tokens_per_microbatch) == ("float32", None, 4096)


# ------------------------------------------------------------------------------------------ overrides
def test_apply_overrides_nested_and_yaml_typed():
    data = {"steps": 5, "engine": {"optimizer": {"lr": 0.1}}}
    out = apply_overrides(
        data,
        [
            "steps=7",
            "engine.optimizer.lr=0.5",
            "engine.scheduler.kind=cosine",
            "engine.optimizer.max_grad_norm=null",
            "engine.optimizer.betas=[0.8, 0.9]",
            "export_hf_at_end=false",
            "layout=r2d2",
            "tokenizer=a=b",
        ],
    )
    assert out == {
        "steps": 7,
        "engine": {
            "optimizer": {"lr": 0.5, "max_grad_norm": None, "betas": [0.8, 0.9]},
            "scheduler": {"kind": "cosine"},
        },
        "export_hf_at_end": False,
        "layout": "r2d2",
        "tokenizer": "a=b",  # split at the first '='
    }
    assert data == {"steps": 5, "engine": {"optimizer": {"lr": 0.1}}}, "the input must not be modified"


def test_apply_overrides_empty_value_is_empty_string():
    assert apply_overrides({}, ["tokenizer="]) == {"tokenizer": ""}


def test_apply_overrides_without_equals_raises():
    with pytest.raises(ValueError, match="must look like key=value"):
        apply_overrides({}, ["steps"])


def test_apply_overrides_into_a_value_raises():
    with pytest.raises(ValueError, match="'steps' is a value, not a section"):
        apply_overrides({"steps": 3}, ["steps.x=1"])


def test_scientific_notation_override_is_a_float():
    # PyYAML reads "1e-3" as a string; the float field must still accept it (the CLI help's own example).
    data = apply_overrides(REQUIRED, ["engine.optimizer.lr=1e-3", "engine.optimizer.eps=1E-6"])
    config = build_config(SFTConfig, data)
    assert config.engine.optimizer.lr == 1e-3
    assert config.engine.optimizer.eps == 1e-6


# ------------------------------------------------------------------------------------------ build_config
def test_build_sft_config_from_nested_dict():
    data = {
        **REQUIRED,
        "layout": "r2d2",
        "steps": 12,
        "max_seq_len": 64,
        "engine": {
            "max_tokens_per_microbatch": 256,
            "compute_dtype": "bf16",
            "activation_checkpointing": "selective",
            "optimizer": {"lr": 3e-4, "betas": [0.9, 0.95], "max_grad_norm": None, "weight_decay": 0},
            "scheduler": {"kind": "cosine", "warmup_steps": 2, "total_steps": 12, "min_lr_ratio": 0.1},
        },
    }
    config = build_config(SFTConfig, data)
    assert (config.model, config.train_file, config.output_dir) == ("m", "t.jsonl", "out")
    assert (config.layout, config.steps, config.max_seq_len) == ("r2d2", 12, 64)
    assert config.tokenizer is None and config.eval_file is None
    assert config.engine.max_tokens_per_microbatch == 256
    assert config.engine.compute_dtype == "bf16"
    assert config.engine.activation_checkpointing == "selective"
    opt = config.engine.optimizer
    assert opt.lr == 3e-4 and opt.max_grad_norm is None
    assert opt.betas == (0.9, 0.95) and isinstance(opt.betas, tuple)
    assert opt.weight_decay == 0.0 and isinstance(opt.weight_decay, float)
    assert config.engine.scheduler == SchedulerConfig(kind="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert config.engine.param_dtype == "float32"  # untouched defaults survive


def test_config_round_trips_through_dict():
    config = build_config(SFTConfig, {**REQUIRED, "engine": {"optimizer": {"betas": [0.5, 0.6]}}})
    data = config_to_dict(config)
    assert data["engine"]["optimizer"]["betas"] == [0.5, 0.6]
    assert build_config(SFTConfig, data) == config


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError) as info:
        build_config(SFTConfig, {**REQUIRED, "stepz": 3})
    message = str(info.value)
    assert "unknown config key(s) ['stepz'] in SFTConfig" in message
    assert "valid keys:" in message and "'steps'" in message and "'global_batch_size'" in message


def test_unknown_nested_key_names_the_section():
    with pytest.raises(ValueError) as info:
        build_config(SFTConfig, {**REQUIRED, "engine": {"optimizer": {"learning_rate": 1.0}}})
    message = str(info.value)
    assert "['learning_rate'] in engine.optimizer" in message
    assert (
        "valid keys: ['betas', 'eps', 'fused', 'kahan_summation', 'lr', 'max_grad_norm', 'name', 'state_dtype', 'weight_decay']"
        in message
    )


def test_missing_required_keys_raise():
    with pytest.raises(ValueError, match=r"missing required config key\(s\) \['output_dir'\] in SFTConfig"):
        build_config(SFTConfig, {"model": "m"})
    # SFT takes its data from train_file or data.train/data.mix: one of them is required.
    with pytest.raises(ValueError, match=r"SFTConfig needs training data: set train_file: <path.jsonl>, data.train"):
        build_config(SFTConfig, {"model": "m", "output_dir": "o"})


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"steps": "ten"}, r"steps: expected an integer, got 'ten'"),
        ({"steps": True}, r"steps: expected an integer, got True"),
        ({"steps": 1.5}, r"steps: expected an integer, got 1.5"),
        ({"export_hf_at_end": "yes"}, r"export_hf_at_end: expected true/false, got 'yes'"),
        ({"engine": {"optimizer": {"lr": "fast"}}}, r"engine.optimizer.lr: expected a number, got 'fast'"),
        ({"engine": {"optimizer": {"lr": False}}}, r"engine.optimizer.lr: expected a number"),
        ({"model": ["a"]}, r"model: expected a string"),
        ({"max_seq_len": "long"}, r"max_seq_len: 'long' does not match"),
        ({"engine": {"optimizer": {"betas": 0.9}}}, r"engine.optimizer.betas: expected a list, got 0.9"),
        ({"engine": {"optimizer": {"betas": [0.9]}}}, r"engine.optimizer.betas: expected 2 values"),
        ({"engine": 5}, r"config section 'engine' must be a mapping"),
    ],
)
def test_type_errors_name_the_key(data, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_config(SFTConfig, {**REQUIRED, **data})


def test_literal_values_are_validated():
    with pytest.raises(
        ValueError, match=r"engine.scheduler.kind: 'exp' is not one of \['constant', 'linear', 'cosine'\]"
    ):
        build_config(SFTConfig, {**REQUIRED, "engine": {"scheduler": {"kind": "exp"}}})
    with pytest.raises(ValueError, match=r"activation_checkpointing: 'some' is not one of"):
        build_config(EngineConfig, {"activation_checkpointing": "some"})
    assert build_config(SchedulerConfig, {"kind": "linear"}).kind == "linear"


def test_optional_fields_accept_null():
    config = build_config(SFTConfig, {**REQUIRED, "max_seq_len": None, "engine": {"compute_dtype": None}})
    assert config.max_seq_len is None and config.engine.compute_dtype is None


# ------------------------------------------------------------------------------------------ load_yaml
def test_load_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\nengine:\n  optimizer:\n    lr: 3.0e-3\n")
    assert load_yaml(path) == {"steps": 3, "engine": {"optimizer": {"lr": 0.003}}}
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_yaml(empty) == {}


def test_load_yaml_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must contain a mapping"):
        load_yaml(path)
