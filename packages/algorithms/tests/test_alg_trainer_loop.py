"""The shared run loop (world 1): every trainer refuses a changed data order on resume, drops a
crashed run's metrics past the checkpoint, accepts ``async_checkpoint`` and exports LoRA adapters.

Trainers are looked up through `TRAINERS` (the CLI's path), so these tests hold for every trainer
the registry names, wherever its module lives."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.config_io import apply_overrides, build_config
from shardforge.algorithms.trainers import TRAINERS

REWARD_MODULE = textwrap.dedent(
    """
    def has_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)
    """
)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("loop")
    train = tiny_assets(root, seed=11, max_operand=20, num_eval=16, data_seed=2)["train"]
    pairs = root / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "x"}) + "\n" for i in range(8))
    )
    (root / "loop_rewards_mod.py").write_text(REWARD_MODULE)
    sys.path.insert(0, str(root))
    return {"model": str(root / "model"), "train": str(train), "pairs": str(pairs)}


def _config(name: str, assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    engine = {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-3}}
    data: dict[str, Any] = {
        "model": assets["model"], "output_dir": str(out), "layout": "d1", "steps": 2, "save_every": 1,
        "progress": False, "export_hf_at_end": False, "engine": engine,
    }  # fmt: skip
    if name == "sft":
        data |= {"train_file": assets["train"], "global_batch_size": 4}
    elif name == "rm":
        data |= {"train_file": assets["pairs"], "global_batch_size": 2}
    else:
        data |= {"train_file": assets["train"], "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3}
        data |= {"reward_fn": "loop_rewards_mod:has_seven"}
    if name == "ppo":
        data |= {"update_epochs": 1, "critic_engine": dict(engine)}
    cls = TRAINERS.get(name).config_cls
    return build_config(cls, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _run(name: str, config: Any) -> dict[str, Any]:
    return TRAINERS.get(name).run(config)


def _records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["split"] == "train"]


def test_grpo_refuses_a_changed_data_order_on_resume(assets: dict[str, Any], tmp_path: Path) -> None:
    """Drift (a): SFT, RM and PPO refused this; GRPO silently trained on another order."""
    _run("grpo", _config("grpo", assets, tmp_path))
    with pytest.raises(ValueError, match=r"cannot resume.*seed: checkpoint 0 vs config 5"):
        _run("grpo", _config("grpo", assets, tmp_path, steps=3, seed=5))


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_resume_drops_metrics_past_the_checkpoint(name: str, assets: dict[str, Any], tmp_path: Path) -> None:
    """Drift (b): a crash after step 3 was logged but before its checkpoint; the resumed run
    (from step 2) must not keep the crashed run's step-3 record next to its own."""
    _run(name, _config(name, assets, tmp_path))
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({"step": 3, "split": "train", "loss": 999.0}) + "\n")
    _run(name, _config(name, assets, tmp_path, steps=3))
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["loss"] != 999.0


@pytest.mark.parametrize("name", ["sft", "rm", "grpo", "ppo"])
def test_every_trainer_takes_async_checkpoint(name: str, assets: dict[str, Any], tmp_path: Path) -> None:
    """Drift (c): only SFT had ``async_checkpoint``."""
    config = _config(name, assets, tmp_path, async_checkpoint="async")
    assert config.async_checkpoint == "async"
    if name in ("sft", "rm"):  # the quick ones also run: the last checkpoint is committed at the end
        _run(name, config)
        assert (tmp_path / "checkpoints").is_dir()
        resumed = _run(name, _config(name, assets, tmp_path, steps=3, async_checkpoint="async"))
        assert resumed["resumed_from"] == 2


def test_ppo_exports_lora_adapters(assets: dict[str, Any], tmp_path: Path) -> None:
    """Drift (d): SFT and GRPO wrote output_dir/lora with engine.lora set; PPO did not."""
    overrides = {
        "steps": 1, "save_every": 0, "export_hf_at_end": "true", "engine.lora.r": "4",
        "engine.lora.target_modules": "[q_proj,v_proj]",
    }  # fmt: skip
    summary = _run("ppo", _config("ppo", assets, tmp_path, **overrides))
    assert summary["lora_dir"] == str(tmp_path / "lora")
    assert (tmp_path / "lora" / "adapter_config.json").is_file()


def test_damaged_newest_checkpoint_is_named_and_latest_valid_resumes_from_the_previous(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    from shardforge.checkpoint_dcp import CorruptCheckpointError

    _run("sft", _config("sft", assets, tmp_path))  # checkpoints at steps 1 and 2
    step_dir = tmp_path / "checkpoints" / "step_00000002"
    data = sorted(step_dir.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:16])  # what a full disk or a partial copy leaves
    with pytest.raises(CorruptCheckpointError) as info:
        _run("sft", _config("sft", assets, tmp_path, steps=3))
    assert str(data) in str(info.value) and "resume=latest_valid" in str(info.value)
    summary = _run("sft", _config("sft", assets, tmp_path, steps=3, resume="latest_valid"))
    assert summary["resumed_from"] == 1
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3]


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_sequences_longer_than_the_models_positions_are_refused(
    name: str, assets: dict[str, Any], tmp_path: Path
) -> None:
    import shutil

    model = tmp_path / "short_model"
    shutil.copytree(assets["model"], model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 6  # the addition rows are ~10 tokens
    (model / "config.json").write_text(json.dumps(config))
    expected = "max_position_embeddings=6" + (" (longest" if name == "sft" else "")
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        _run(name, _config(name, {**assets, "model": str(model)}, tmp_path / "out"))
    assert ("max_seq_len" if name == "sft" else "max_prompt_len") in str(info.value)


def test_every_run_ends_with_curves_and_shows_eval_metrics_in_the_log(
    assets: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("matplotlib")
    config = _config("sft", assets, tmp_path, eval_every=1, eval_file=assets["train"], eval_batch_size=4)
    with caplog.at_level("INFO", logger="shardforge.algorithms.trainers.base"):
        summary = _run("sft", config)
    png = tmp_path / "curves.png"
    assert summary["curves"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    evals = [r.getMessage() for r in caplog.records if " eval: " in r.getMessage()]
    assert [m.split(" eval:")[0] for m in evals] == ["step 1", "step 2"] and "loss " in evals[0]


def test_profile_writes_a_chrome_trace_of_the_chosen_steps(assets: dict[str, Any], tmp_path: Path) -> None:
    config = _config("sft", assets, tmp_path, steps=3, **{"profile.enabled": "true", "profile.start_step": 2})
    _run("sft", config)
    traces = sorted((tmp_path / "profile").iterdir())
    assert [t.name for t in traces] == ["rank0_steps2-3.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)  # operators were recorded
    off = _config("sft", assets, tmp_path / "off")
    _run("sft", off)
    assert not (tmp_path / "off" / "profile").exists()
    with pytest.raises(ValueError, match=re.escape("profile.start_step=0")):
        _config("sft", assets, tmp_path, **{"profile.start_step": 0})
    memory = _config(
        "sft", assets, tmp_path / "mem", steps=2, **{"profile.enabled": "true", "profile.profile_memory": "true"}
    )
    _run("sft", memory)
    table = (tmp_path / "mem" / "profile" / "rank0_steps2-2_memory.txt").read_text()  # CPU: the memory table
    assert "CPU Mem" in table and "aten::" in table, table[:500]


SINKS_MODULE = textwrap.dedent(
    """
    CALLS = []

    class Flaky:
        def log(self, step, values, split):
            CALLS.append(step)
            if step == 2:
                raise ConnectionError("tracker went away")

        def close(self):
            pass

    def flaky(out_dir, run_config):
        assert run_config["steps"] == 3  # the run's config reaches the sink
        return Flaky()

    def broken(out_dir, run_config):
        raise RuntimeError("no credentials")
    """
)


def test_failing_loggers_are_reported_once_and_training_goes_on(
    assets: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "loop_sinks_mod.py").write_text(SINKS_MODULE)
    sys.path.insert(0, str(tmp_path))
    import loop_sinks_mod  # type: ignore[import-not-found]

    names = "[jsonl, 'loop_sinks_mod:flaky', 'loop_sinks_mod:broken']"
    with caplog.at_level("WARNING", logger="shardforge.algorithms.loggers.registry"):
        summary = _run("sft", _config("sft", assets, tmp_path / "run", steps=3, loggers=names))
    assert summary["steps"] == 3
    assert loop_sinks_mod.CALLS == [1, 2]  # disabled after its failure at step 2, not called at step 3
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "'loop_sinks_mod:broken' failed to start (RuntimeError: no credentials)" in warnings[0]
    assert "'loop_sinks_mod:flaky' failed to log (ConnectionError: tracker went away)" in warnings[1]
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2, 3]  # jsonl kept logging
    with pytest.raises(ValueError, match=r"unknown metrics logger 'nope'; registered: .*jsonl"):
        _run("sft", _config("sft", assets, tmp_path / "bad", loggers="[nope]"))


def test_a_start_of_run_evaluation_does_not_count_in_the_first_steps_reward_calls(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    """Issue 42 item 7: a resumed run's per-step metrics equal the uninterrupted run's; the evaluation at the
    start of a run (every resumed run has one) used to add its reward calls to the next step's."""
    plain = _run("grpo", _config("grpo", assets, tmp_path / "plain", steps=1, save_every=0))
    evaluated = _config(
        "grpo", assets, tmp_path / "eval", steps=1, save_every=0, eval_file=assets["train"], eval_size=6
    )
    _run("grpo", evaluated)
    assert plain["steps"] == 1
    calls = [_records(out)[0]["reward/calls"] for out in (tmp_path / "plain", tmp_path / "eval")]
    assert calls[0] == 4.0  # prompts_per_step 2 x group_size 2
    assert calls == [4.0, 4.0]
