"""An export that a plain `transformers` / `peft` user gets right (issue 24): the exported tokenizer
produces what training fed (BOS), the base model's ``use_cache`` and a ``generation_config.json``
are kept, no load-time keys in the tokenizer config, and the LoRA adapter's base path resolves from
any directory. One FSDP-2 run (the path where the engine's meta model shares its config)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from shardforge.algorithms.data import tokenize_sft_row
from shardforge.algorithms.demos.evaluation import greedy_answers
from shardforge.algorithms.testing import tiny_assets


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_users")
    tiny_assets(root / "assets", max_operand=9, num_eval=10, tokenizer_dir="model")
    config = {
        "model": "assets/model",  # relative, as users write it: the adapter must store it absolute
        "train_file": "assets/data/train.jsonl",
        "output_dir": "run",
        "global_batch_size": 8,
        "steps": 2,
        "progress": False,
        "engine": {"max_tokens_per_microbatch": 64, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}},
    }
    (root / "c.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "sft", "--config", "c.yaml",
               "--nproc-per-node", "2"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root


def test_exported_tokenizer_gives_the_ids_training_fed_and_plain_generate_matches(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run / "run" / "hf")
    prompt = "3+4="
    fed = tokenize_sft_row({"prompt": prompt, "completion": "7"}, tokenizer)
    prompt_ids = fed.input_ids[: fed.loss_mask.index(1.0)]
    assert tokenizer(prompt)["input_ids"] == prompt_ids  # BOS included, as in training
    model = AutoModelForCausalLM.from_pretrained(run / "run" / "hf").eval()
    inputs = tokenizer([prompt], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    plain = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert plain == greedy_answers(model, tokenizer, [prompt], max_new_tokens=4)[0]


def test_export_keeps_use_cache_and_writes_generation_config(run):
    base = json.loads((run / "assets" / "model" / "config.json").read_text())
    exported = json.loads((run / "run" / "hf" / "config.json").read_text())
    assert base["use_cache"] is True and exported["use_cache"] is True
    generation = json.loads((run / "run" / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == base["eos_token_id"]


def test_exported_tokenizer_config_has_no_load_time_keys(run):
    tokenizer_config = json.loads((run / "run" / "hf" / "tokenizer_config.json").read_text())
    assert "is_local" not in tokenizer_config and "local_files_only" not in tokenizer_config


def test_lora_adapter_loads_from_another_directory(run, monkeypatch, tmp_path):
    from peft import AutoPeftModelForCausalLM

    adapter = json.loads((run / "run" / "lora" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((run / "assets" / "model").resolve())
    monkeypatch.chdir(tmp_path)
    model = AutoPeftModelForCausalLM.from_pretrained(str(run / "run" / "lora"))
    assert model is not None
