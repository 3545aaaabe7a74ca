"""The `shardforge` CLI: argument errors, and a full tiny single-process SFT run."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardforge.algorithms.cli.main import main
from shardforge.algorithms.loggers import read_metrics
from shardforge.algorithms.testing import tiny_assets
from shardforge.algorithms.testing.tiny import make_addition_data


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_assets")
    tiny_assets(root, data=False)
    train, evaluation = make_addition_data(root / "data", max_operand=9, num_eval=10)
    return {"root": root, "model": root / "model", "train": train, "eval": evaluation}


def write_config(path, **entries):
    base = {"global_batch_size": 8, "progress": False, "engine": {"max_tokens_per_microbatch": 64}}
    base.update(entries)
    path.write_text(yaml.safe_dump(base))
    return str(path)


# ------------------------------------------------------------------------------------------ argument errors
def test_unknown_algorithm_exits(tmp_path):
    with pytest.raises(ValueError, match=r"unknown algorithm 'orpo'; available: \[") as err:
        main(["--debug", "train", "orpo", "--config", write_config(tmp_path / "c.yaml")])
    assert_lists_core_algorithms(str(err.value))


def assert_lists_core_algorithms(message: str) -> None:
    listed = message.split("available: ", 1)[1]
    for name in ("dpo", "grpo", "ppo", "rm", "sft"):
        assert f"'{name}'" in listed, message


@pytest.mark.parametrize("algorithm", ["rm", "ppo"])
def test_rm_and_ppo_read_their_own_config(tmp_path, algorithm):
    # The trainers exist: an SFT-only key is rejected by their config, naming their valid keys.
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \[.*'global_batch_sizez'\].*valid keys"):
        main(["--debug", "train", algorithm, "--config", write_config(tmp_path / "c.yaml", global_batch_sizez=3)])


@pytest.mark.parametrize("bad", ["steps", "--steps=3"])
def test_bad_override_exits_with_usage_error(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as info:
        main(["train", "sft", "--config", write_config(tmp_path / "c.yaml"), bad])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {bad}" in err and "overrides look like key=value" in err


def test_missing_config_flag_exits(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "sft"])
    assert info.value.code == 2
    assert "--config" in capsys.readouterr().err


def test_overrides_are_not_accepted_by_demo(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "steps=3"])
    assert "unrecognized arguments: steps=3" in capsys.readouterr().err


def test_missing_config_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config file .* does not exist"):
        main(["--debug", "train", "sft", "--config", str(tmp_path / "none.yaml")])


def test_unknown_config_key_raises(tmp_path):
    config = write_config(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['stepz'\]"):
        main(["--debug", "train", "sft", "--config", config, "stepz=3", "model=m", "train_file=t", "output_dir=o"])


# ------------------------------------------------------------------------------------------ full run
def test_tiny_sft_run_end_to_end(tmp_path, assets, capsys):
    out = tmp_path / "run"
    config = write_config(
        tmp_path / "sft.yaml",
        model=str(assets["model"]),
        train_file=str(assets["train"]),
        eval_file=str(assets["eval"]),
        output_dir=str(out),
    )
    code = main(["train", "sft", "--config", config, "steps=3", "engine.optimizer.lr=1e-3", "eval_batch_size=16"])
    assert code == 0
    assert "[shardforge] done:" in capsys.readouterr().out

    train = read_metrics(out / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    for record in train:
        assert record["lr"] == pytest.approx(1e-3)  # the 1e-3 override arrived as a float
        assert record["loss"] > 0 and record["loss_weight"] > 0 and record["tokens"] > 0
        assert record["tokens_per_s"] > 0 and record["skipped"] == 0.0
    evaluation = read_metrics(out / "metrics.jsonl", "eval")
    assert [r["step"] for r in evaluation] == [3]  # eval_every=0: only at the end

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["train_loss"] == pytest.approx(train[-1]["loss"])
    assert summary["eval_loss"] == pytest.approx(evaluation[0]["loss"])
    assert summary["layout"] == "r1d1c1t1p1e1x1"
    saved = json.loads((out / "config.json").read_text())
    assert saved["steps"] == 3 and saved["engine"]["optimizer"]["lr"] == 1e-3
    assert any((out / "tensorboard").iterdir())

    hf = out / "hf"
    assert summary["hf_dir"] == str(hf)
    model = AutoModelForCausalLM.from_pretrained(hf)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert tokenizer("1+1=", add_special_tokens=False)["input_ids"] == [5, 14, 5, 17]
    start = AutoModelForCausalLM.from_pretrained(assets["model"])
    name = "model.embed_tokens.weight"
    assert not torch.equal(model.get_parameter(name), start.get_parameter(name)), "the export holds trained weights"


def test_row_missing_fields_fails_before_training(tmp_path, assets):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="}\n')
    out = tmp_path / "run"
    config = write_config(tmp_path / "sft.yaml", model=str(assets["model"]), train_file=str(data), output_dir=str(out))
    with pytest.raises(
        ValueError, match=r"bad.jsonl:2: the row has fields \['prompt'\]; expected 'prompt'\+'completion' or 'messages'"
    ):
        main(["--debug", "train", "sft", "--config", config, "steps=3"])
    assert not out.exists()


def test_sequence_longer_than_budget_names_the_setting(tmp_path, assets):
    out = tmp_path / "run"
    config = write_config(
        tmp_path / "sft.yaml", model=str(assets["model"]), train_file=str(assets["train"]), output_dir=str(out)
    )
    with pytest.raises(ValueError) as info:
        main(["--debug", "train", "sft", "--config", config, "engine.max_tokens_per_microbatch=4"])
    message = str(info.value)
    assert "longer than engine.max_tokens_per_microbatch=4" in message
    assert "raise engine.max_tokens_per_microbatch to >= " in message and "max_seq_len" in message
    assert not out.exists()


# ------------------------------------------------------------------------------------------ registries
def test_list_prints_every_registry_with_names_and_descriptions(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for header, names in {
        "trainer:": ["sft", "rm", "ppo", "grpo"],
        "policy loss:": ["vanilla", "gspo"],
        "advantage estimator:": ["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"],
        "KL estimator:": ["k1", "k2", "k3"],
        "loss aggregation:": ["token-mean", "seq-mean-token-sum-norm"],
        "reward function:": ["exact_match"],
        "rollout engine:": ["hf", "vllm"],
        "advantage stage:": ["group", "gae", "teacher_kl", "teacher_nll"],
        "workflow:": ["rlvr", "multi_turn", "tool_use"],
    }.items():
        assert header in out
        section = out.split(header, 1)[1].split("\n\n", 1)[0]
        for name in names:
            assert f"  {name} " in section, (header, name)
    assert "supervised fine-tuning" in out  # one line per entry


def test_list_imports_no_vllm_code():
    import subprocess
    import sys

    code = (
        "import sys; from shardforge.algorithms.cli.main import main; main(['list']); "
        "print([m for m in sys.modules if 'vllm' in m])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_unknown_trainer_lists_registered_ones(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown algorithm 'orpo'; available: \[") as err:
        main(["--debug", "--log-level", "debug", "train", "orpo", "--config", write_config(tmp_path / "c.yaml")])
    assert_lists_core_algorithms(str(err.value))
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        main(["train", "nope", "--debug", "--log-level", "WARNING", "--config", write_config(tmp_path / "c.yaml")])


def test_log_level_is_checked(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--log-level", "LOUD", "list"])
    assert info.value.code == 2 and "invalid choice: 'LOUD'" in capsys.readouterr().err


USER_TRAINER = '''
from dataclasses import dataclass
from pathlib import Path

from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.run.config import TrainerConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class EchoConfig(TrainerConfig):
    word: str = "hi"
    """What to write."""


def run(config):
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(config.output_dir) / "echo.txt").write_text(config.word)
    return {"word": config.word}


TRAINER = TrainerSpec(config_cls=EchoConfig, run=run)
NOT_A_TRAINER = 3
'''


def test_a_users_trainer_runs_by_import_path(tmp_path, monkeypatch):
    """``shardforge train package.module:TRAINER``: a user's `TrainerSpec` through the same CLI (config, overrides,
    preflight), as DESIGN.md asks of every registered kind."""
    from shardforge.algorithms.testing import tiny_assets

    (tmp_path / "my_trainers.py").write_text(USER_TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    assets = tiny_assets(tmp_path / "assets")
    config = tmp_path / "c.yaml"
    data = {"model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(tmp_path / "out")}
    config.write_text(yaml.safe_dump(data))
    config = str(config)
    assert main(["train", "my_trainers:TRAINER", "--config", config, "word=bonjour"]) == 0
    assert (tmp_path / "out" / "echo.txt").read_text() == "bonjour"
    with pytest.raises(ValueError, match="'my_trainers:NOT_A_TRAINER' is a int, not a TrainerSpec"):
        main(["--debug", "train", "my_trainers:NOT_A_TRAINER", "--config", config])
