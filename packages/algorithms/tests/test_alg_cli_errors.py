"""What a new user sees first (issue 24): one clear error before any rank starts, `--help` that
lists config keys, `--version`, and the small run-loop outputs (config.json, checkpoints/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from shardforge.algorithms.cli.main import main
from shardforge.algorithms.testing import tiny_assets


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("cli_errors"), max_operand=9, num_eval=10)


def config_file(tmp_path, assets, **entries):
    base = {
        "model": str(assets["model"]),
        "train_file": str(assets["train"]),
        "output_dir": str(tmp_path / "run"),
        "global_batch_size": 8,
        "progress": False,
        "engine": {"max_tokens_per_microbatch": 64},
    }
    base.update(entries)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base))
    return str(path)


def run_cli(capsys, *argv):
    """main(argv) -> (exit code, stderr); the error must be one line and no traceback."""
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code, err, *fragments):
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardforge: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


# ------------------------------------------------------------------------------------------ before launch
def test_layout_needing_more_ranks_names_the_ranks_and_the_flag(tmp_path, assets, capsys):
    started = time.time()
    code, err = run_cli(capsys, "train", "sft", "--config", config_file(tmp_path, assets), "--nproc-per-node", "2",
                        "layout=d2t2")  # fmt: skip
    assert_one_line_error(code, err, "layout='d2t2' needs 4 ranks", "--nproc-per-node is 2",
                          "run with --nproc-per-node 4", "'d-1'")  # fmt: skip
    assert "dp_shard" not in err  # the internal name is not what users write
    assert time.time() - started < 10  # no torchrun was started
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("algorithm", ["sft", "rm", "grpo", "ppo"])
def test_missing_model_path_is_a_local_error_not_a_hub_lookup(tmp_path, assets, capsys, algorithm):
    config = config_file(tmp_path, assets, model="no/such/model")
    if algorithm in ("grpo", "ppo"):  # they take prompts_per_step, not global_batch_size
        config = rl_config(config)
    code, err = run_cli(capsys, "train", algorithm, "--config", config)
    assert_one_line_error(code, err, "model='no/such/model' does not exist", "shardforge prepare-tiny")
    assert "Repo id" not in err


def rl_config(path):
    data = yaml.safe_load(open(path))
    data.pop("global_batch_size")
    open(path, "w").write(yaml.safe_dump(data))
    return path


def test_empty_data_file_names_the_file(tmp_path, assets, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, err = run_cli(capsys, "train", "sft", "--config", config_file(tmp_path, assets, train_file=str(empty)))
    assert_one_line_error(code, err, f"{empty}", "is empty")


def test_malformed_json_line_names_the_file_and_1_based_line(tmp_path, assets, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = ['{"prompt": "1+1=", "completion": "2"}'] * 5 + ['{"prompt": "1+2=", "completion": 3']
    bad.write_text("\n".join(lines) + "\n")
    code, err = run_cli(capsys, "train", "sft", "--config", config_file(tmp_path, assets, eval_file=str(bad)))
    assert_one_line_error(code, err, f"{bad}:6: not valid JSON", "one JSON object")


def test_row_with_wrong_fields_names_the_expected_ones(tmp_path, assets, capsys):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1+1=", "chosen": "2"}\n')
    config = config_file(tmp_path, assets, train_file=str(bad))
    code, err = run_cli(capsys, "train", "rm", "--config", config)
    assert_one_line_error(code, err, f"{bad}:2: the row has fields ['chosen', 'prompt']",
                          "expected 'prompt'+'chosen'+'rejected'")  # fmt: skip


@pytest.mark.parametrize(("override", "message"), [("steps=-5", "steps=-5 is invalid; it must be >= 1"),
                                                   ("log_every=0", "log_every=0 is invalid")])  # fmt: skip
def test_invalid_counts_are_refused(tmp_path, assets, capsys, override, message):
    code, err = run_cli(capsys, "train", "sft", "--config", config_file(tmp_path, assets), override)
    assert_one_line_error(code, err, message)


def test_global_batch_smaller_than_dp_is_refused_before_launch(tmp_path, assets, capsys):
    config = config_file(tmp_path, assets, global_batch_size=1)
    code, err = run_cli(capsys, "train", "sft", "--config", config, "--nproc-per-node", "2")
    assert_one_line_error(code, err, "global_batch_size=1 is smaller than the data-parallel size 2")


def test_prompts_per_step_must_split_across_ranks(tmp_path, assets, capsys):
    config = rl_config(config_file(tmp_path, assets))
    code, err = run_cli(capsys, "train", "grpo", "--config", config, "--nproc-per-node", "2", "prompts_per_step=3")
    assert_one_line_error(code, err, "prompts_per_step=3 must be a positive multiple of the data-parallel size 2")


def test_missing_reward_model_directory_names_the_key(tmp_path, assets, capsys):
    config = rl_config(config_file(tmp_path, assets))
    code, err = run_cli(capsys, "train", "grpo", "--config", config, f"reward_model.path={tmp_path / 'no-rm'}")
    assert_one_line_error(code, err, "reward_model.path=", "does not exist")


def test_output_dir_under_a_file_is_refused(tmp_path, assets, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    config = config_file(tmp_path, assets, output_dir=str(blocker / "run"))
    code, err = run_cli(capsys, "train", "sft", "--config", config)
    assert_one_line_error(code, err, "exists and is not a directory")


def test_unknown_key_and_unknown_algorithm_are_one_line(tmp_path, assets, capsys):
    config = config_file(tmp_path, assets)
    assert_one_line_error(*run_cli(capsys, "train", "sft", "--config", config, "stepz=3"), "unknown config key(s)")
    assert_one_line_error(*run_cli(capsys, "train", "orpo", "--config", config), "unknown algorithm 'orpo'")


def test_debug_shows_the_traceback(tmp_path, assets):
    with pytest.raises(ValueError, match="steps=-5"):
        main(["--debug", "train", "sft", "--config", config_file(tmp_path, assets), "steps=-5"])


def test_error_inside_ranks_is_one_line_without_tracebacks(tmp_path, assets):
    # A problem only the ranks see (sequences longer than the micro-batch budget, found while
    # tokenising): rank 0 prints one line, torchrun's ChildFailedError block is not shown.
    config = config_file(tmp_path, assets)
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "sft", "--config", config,
               "--nproc-per-node", "2", "engine.max_tokens_per_microbatch=4"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr
    assert result.stderr.count("longer than engine.max_tokens_per_microbatch=4") == 1, result.stderr


# ------------------------------------------------------------------------------------------ help, version
def test_train_help_lists_config_keys_with_types_defaults_and_docs(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "sft", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "config keys of `sft`" in out
    assert "  steps (int, default 100)\n      Optimizer steps" in out
    assert "  model (str, default (required))\n      HF model directory" in out
    assert "  global_batch_size (int, default 32)\n      Sequences per optimizer step" in out
    assert "  engine.optimizer.lr (float, default" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("shardforge 0.")


def test_demo_rejects_overrides_saying_what_it_takes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "x=1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: x=1 (`demo` takes no key=value" in err and "overrides look like" not in err


# ------------------------------------------------------------------------------------------ run outputs
def test_run_writes_resolved_schedule_no_empty_checkpoints_and_logs_changed_steps(tmp_path, assets, capsys):
    config = config_file(tmp_path, assets, engine={"max_tokens_per_microbatch": 64, "scheduler": {"kind": "cosine"}})
    out = tmp_path / "run"
    assert main(["train", "sft", "--config", config, "steps=2"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["engine"]["scheduler"]["total_steps"] == 2  # resolved from steps, not the placeholder 1
    assert not (out / "checkpoints").exists()  # save_every=0 makes no checkpoint directory

    assert main(["train", "sft", "--config", config, "steps=2", "save_every=2", "export_hf_at_end=false"]) == 0
    assert (out / "checkpoints").is_dir()
    capsys.readouterr()
    assert main(["train", "sft", "--config", config, "steps=3", "export_hf_at_end=false"]) == 0
    out_text = capsys.readouterr().out
    assert "steps changed from 2 (the previous run) to 3: training continues from step 2 to 3" in out_text


def test_launcher_prints_the_first_failing_ranks_line_whichever_rank_it_was(tmp_path, monkeypatch):
    # CI saw rank 1 fail first and the agent stop rank 0 (-15) before rank 0 could print: the
    # launcher must print rank 1's line, once, not "rank 0 exited with code -15".
    from shardforge.algorithms.launch.torchrun import ERROR_DIR_ENV, first_rank_error, write_rank_error

    monkeypatch.delenv(ERROR_DIR_ENV, raising=False)
    assert write_rank_error("x\n") is False  # nobody listening: the caller prints itself
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    assert first_rank_error(tmp_path) is None
    monkeypatch.setenv("RANK", "1")
    assert write_rank_error("shardforge: error: from rank 1\n")
    monkeypatch.setenv("RANK", "0")
    assert write_rank_error("shardforge: error: from rank 0, later\n")
    assert first_rank_error(tmp_path) == "shardforge: error: from rank 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]


def test_dry_run_prints_config_layout_memory_and_rows_and_starts_nothing(tmp_path, assets, capsys):
    config = config_file(tmp_path, assets, eval_file=str(assets["eval"]))
    code = main(["train", "sft", "--config", config, "--nproc-per-node", "2", "--dry-run", "layout=d2", "steps=7"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert '"steps": 7' in out and '"layout": "d2"' in out  # overrides applied
    assert "layout: d2 -> " in out and "over 2 rank(s)" in out
    assert "predicted per-rank memory" in out and "total" in out
    train_rows = sum(1 for line in open(assets["train"]) if line.strip())
    assert f"({train_rows} rows)" in out and "eval_file:" in out
    assert not (tmp_path / "run").exists()  # nothing was started or written
    # still refused when something is wrong, before printing anything
    code = main(["train", "sft", "--config", config, "--nproc-per-node", "3", "--dry-run", "layout=d2"])
    assert code == 1
