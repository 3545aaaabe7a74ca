"""The launching process's checks (`preflight`): what they read, and what they refuse before any rank starts."""

from __future__ import annotations

import json

import pytest
from transformers import Qwen3Config

from shardforge.algorithms.cli import preflight as preflight_module
from shardforge.algorithms.cli.preflight import needs_model_config, preflight
from shardforge.algorithms.config_io import build_config
from shardforge.algorithms.trainers.sft import SFTConfig
from shardforge.mesh import ParallelDims


@pytest.fixture
def run_files(tmp_path):
    """A model directory (config.json only: preflight never reads weights), a tokenizer dir and one data row."""
    model = tmp_path / "model"
    Qwen3Config(
        vocab_size=32, hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=8,
    ).save_pretrained(model)  # fmt: skip
    (tmp_path / "tok").mkdir()
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    return {"model": str(model), "tokenizer": str(tmp_path / "tok"), "train_file": str(train),
            "output_dir": str(tmp_path / "out"), "global_batch_size": 4}  # fmt: skip


def test_data_parallel_layouts_do_not_load_the_model_config(run_files, monkeypatch):
    # The launcher only checks that the directory holds a config.json: importing transformers' config
    # classes here cost seconds of start-up, and each rank loads the config and repeats the checks.
    def fail(path):
        raise AssertionError(f"load_hf_config({path}) called for a data-parallel layout")

    monkeypatch.setattr(preflight_module, "load_hf_config", fail)
    for layout in ("d2", "r2"):
        dims = preflight(build_config(SFTConfig, {**run_files, "layout": layout}), 2)
        assert dims.world_size == 2


def test_model_sharding_layouts_check_the_model_before_any_rank(run_files):
    # 3 attention heads cannot be split over tp=2: refused in the launching process, with the valid sizes.
    with pytest.raises(ValueError, match=r"tp=2 must divide .*valid tp for this model: \[1\]"):
        preflight(build_config(SFTConfig, {**run_files, "layout": "t2"}), 2)


def test_a_model_dir_without_config_json_is_refused_for_every_layout(run_files, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        preflight(build_config(SFTConfig, {**run_files, "model": str(empty), "layout": "d2"}), 2)


@pytest.mark.parametrize(
    ("layout", "engine", "needed"),
    [
        ("d4", {}, False),
        ("r2d2", {}, False),
        ("d2t2", {}, True),
        ("d2c2", {}, True),
        ("p2d2", {}, True),
        ("d4e2", {}, True),
        ("d4", {"head": "value"}, True),
        ("d4", {"router_replay": True}, True),
    ],
)
def test_needs_model_config(layout, engine, needed):
    config = build_config(SFTConfig, {"model": "m", "train_file": "t", "output_dir": "o", "engine": engine})
    assert needs_model_config(ParallelDims.parse(layout).resolve(4), config.engine) is needed


def test_a_one_process_run_parses_its_data_once(run_files, monkeypatch):
    # `shardforge train` with one rank trains in the launching process: the rows preflight read are
    # handed to the trainer's read of the same file instead of being parsed again.
    from shardforge.algorithms.data import jsonl

    parsed = []
    real = jsonl.iter_jsonl
    monkeypatch.setattr(jsonl, "iter_jsonl", lambda *a, **k: parsed.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(jsonl, "_KEPT", {})
    config = build_config(SFTConfig, {**run_files, "layout": "d1"})
    preflight(config, 1, (("prompt", "completion"),), keep_rows=True)
    rows = jsonl.read_jsonl(run_files["train_file"], "train file", (("prompt", "completion"),))
    assert rows == [(1, {"prompt": "1+1=", "completion": "2"})] and len(parsed) == 1
    jsonl.read_jsonl(run_files["train_file"], "train file", (("prompt", "completion"),))
    assert len(parsed) == 2  # handed over once: a later read parses the file again
    two_ranks = build_config(SFTConfig, {**run_files, "layout": "d2"})
    preflight(two_ranks, 2, (("prompt", "completion"),))  # a launcher (ranks elsewhere) keeps nothing
    assert jsonl._KEPT == {}
    preflight(config, 1, (("prompt", "completion"),), keep_rows=True)
    with open(run_files["train_file"], "a") as handle:  # the file changed since: parsed again, new row seen
        handle.write(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    assert len(jsonl.read_jsonl(run_files["train_file"], "train file", (("prompt", "completion"),))) == 2
