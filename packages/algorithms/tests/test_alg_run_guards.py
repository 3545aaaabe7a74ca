"""Guards of a run's output directory (issue 42, items 1 and 2).

- The run lock: a second run on a live folder fails in one line naming the live run; a dead run's lock
  is taken over with a warning; ``kill -9`` on the launcher takes every rank with it.
- The resume check: a checkpoint of another experiment (another lr, model, loss, ...) is refused with
  the differing keys; changed steps / cadences / layout are allowed and listed; ``resume=force`` goes on.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardforge.algorithms.config_io import apply_overrides, build_config
from shardforge.algorithms.testing import tiny_assets
from shardforge.algorithms.testing.processes import alive, descendants
from shardforge.algorithms.trainers import TRAINERS
from shardforge.algorithms.trainers.run.lock import LOCK_NAME, OutputDirLock, OutputDirLocked
from shardforge.algorithms.trainers.run.resume_check import ResumeConfigMismatch, config_differences


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return tiny_assets(tmp_path_factory.mktemp("guards"), max_operand=9, num_eval=10)


@pytest.fixture
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------------------------------------- the lock


def test_a_second_lock_on_a_live_folder_names_the_live_run(tmp_path: Path) -> None:
    with OutputDirLock(tmp_path, command="shardforge train sft --config a.yaml"):
        with pytest.raises(OutputDirLocked) as info:
            OutputDirLock(tmp_path).acquire()
    message = str(info.value)
    assert f"PID {os.getpid()} on {socket.gethostname()}" in message
    assert "shardforge train sft --config a.yaml" in message and "another output_dir" in message
    assert not (tmp_path / LOCK_NAME).exists()  # released on exit
    OutputDirLock(tmp_path).acquire().release()  # and free again


def test_a_dead_runs_lock_is_taken_over_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID that no longer runs
    stale = {"pid": dead.pid, "host": socket.gethostname(), "start_time": None, "since": "then", "command": "x"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    with caplog.at_level(logging.WARNING), OutputDirLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert any(f"PID {dead.pid}" in r.getMessage() and "is gone" in r.getMessage() for r in caplog.records)


def test_a_recycled_pid_does_not_keep_a_stale_lock(tmp_path: Path) -> None:
    """The lock records the process's start time: a live process that reused the PID is not the run."""
    stale = {"pid": os.getpid(), "host": socket.gethostname(), "start_time": "1", "since": "then", "command": "x"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    OutputDirLock(tmp_path).acquire().release()


def test_a_lock_from_another_host_is_refused_with_the_way_out(tmp_path: Path) -> None:
    other = {"pid": 1, "host": "node-elsewhere", "start_time": None, "since": "then", "command": "x"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(OutputDirLocked, match=rf"delete {tmp_path / LOCK_NAME}"):
        OutputDirLock(tmp_path).acquire()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc are Linux's")
def test_another_nodes_launcher_covers_its_ranks_without_taking_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's rendezvous can give global rank 0 to node 1's ranks: they must not try to lock the folder
    node 0's launcher holds (on a shared filesystem they would find it live and refuse their own run)."""
    from shardforge.algorithms.trainers.run.lock import LOCK_HELD_ENV, OutputDirLock, run_lock

    for name in ("WORLD_SIZE", "RANK", LOCK_HELD_ENV):
        monkeypatch.delenv(name, raising=False)
    with OutputDirLock(tmp_path):  # node 0's launcher
        with run_lock(str(tmp_path), node_rank=1):  # node 1's launcher: no error, and its ranks are covered
            assert LOCK_HELD_ENV in os.environ
            monkeypatch.setenv("WORLD_SIZE", "2")
            monkeypatch.setenv("RANK", "0")  # a rank of node 1 that the rendezvous made global rank 0
            with run_lock(str(tmp_path)):
                pass
            monkeypatch.delenv("WORLD_SIZE")
            monkeypatch.delenv("RANK")
        assert LOCK_HELD_ENV not in os.environ


def test_kill_9_on_the_launcher_takes_the_ranks_and_a_second_run_is_refused_meanwhile(
    tmp_path: Path, assets: dict[str, Any]
) -> None:
    out = tmp_path / "run"
    config = tmp_path / "c.yaml"
    settings = {
        "model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(out),
        "global_batch_size": 4, "steps": 100000, "progress": False, "save_every": 5,
        "engine": {"max_tokens_per_microbatch": 64},
    }  # fmt: skip
    config.write_text(yaml.safe_dump(settings))
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "sft", "--config", str(config)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(
        [*command, "--nproc-per-node", "2"], env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and first.poll() is None and not metrics.is_file():
            time.sleep(0.5)
        assert first.poll() is None and metrics.is_file(), first.stderr.read().decode() if first.stderr else ""
        ranks = descendants(first.pid)
        assert len(ranks) >= 2, ranks

        second = subprocess.run([*command, "steps=2"], env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        errors = [line for line in second.stderr.splitlines() if line.startswith("shardforge: error:")]
        assert len(errors) == 1 and f"PID {first.pid} on {socket.gethostname()}" in errors[0], second.stderr

        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in ranks):
            time.sleep(0.2)
        survivors = [pid for pid in ranks if alive(pid)]
        assert not survivors, f"ranks {survivors} outlived their killed launcher"
    finally:
        for pid in ranks if "ranks" in locals() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # The dead run's lock is taken over: a short run in the same folder works (it resumes, same experiment).
    third = subprocess.run([*command, "steps=6", "save_every=0"], env=env, capture_output=True, text=True, timeout=240)
    assert third.returncode == 0, third.stderr
    assert "taking over the lock" in third.stdout + third.stderr, third.stdout + third.stderr
    assert not (out / LOCK_NAME).exists()


def test_the_parent_watch_ends_a_process_whose_parent_is_gone(tmp_path: Path) -> None:
    """The fallback of the parent-death signal (platforms without prctl): a child started by a process that
    exits at once is reparented; its watch thread, told the original parent, ends it within ~0.1 s."""
    child = (
        "import os, pathlib, time; from shardforge.algorithms.launch.torchrun import watch_parent; "
        f"pathlib.Path({str(tmp_path / 'imported')!r}).touch(); "
        "watch_parent(int(os.environ['WATCH_PARENT']), 0.05); time.sleep(60); os._exit(3)"
    )
    middle = (
        "import os, subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], env=dict(os.environ, WATCH_PARENT=str(os.getpid()))); "
        "print(p.pid, flush=True)"
    )
    out = subprocess.run([sys.executable, "-c", middle], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30  # the child imports shardforge first (seconds on a loaded machine)
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.1)
    survived = alive(pid)
    if survived:
        os.kill(pid, signal.SIGKILL)
    assert not survived, "the orphaned child outlived its parent by 30 s"
    assert (tmp_path / "imported").is_file()  # it ended in the watch, not in a failed import


# ------------------------------------------------------------------------------------------ the resume check


def test_config_differences_sort_experiment_from_harmless_keys() -> None:
    old = {"model": "a", "steps": 10, "layout": "d2", "engine": {"optimizer": {"lr": 1e-3, "betas": [0.9, 0.99]}}}
    new = {"model": "a", "steps": 20, "layout": "r2", "engine": {"optimizer": {"lr": 2e-3, "betas": (0.9, 0.99)}}}
    experiment, harmless = config_differences(old, new)
    assert experiment == ["engine.optimizer.lr: 0.001 -> 0.002"]  # the tuple/list of betas is the same value
    assert harmless == ["layout: 'd2' -> 'r2'", "steps: 10 -> 20"]
    experiment, _ = config_differences(old, {**old, "new_option": 1})
    assert experiment == ["new_option: '<absent>' -> 1"]  # unknown keys are guarded
    mix = {"data": {"mix": [{"source": "a", "weight": 0.7}, {"source": "b", "weight": 0.3}]}}
    reweighted = {"data": {"mix": [{"source": "a", "weight": 0.2}, {"source": "b", "weight": 0.8}]}}
    assert config_differences(mix, reweighted)[0] == []  # a curriculum: each source continues where it was
    resourced = {"data": {"mix": [{"source": "a", "weight": 0.7}, {"source": "c", "weight": 0.3}]}}
    assert config_differences(mix, resourced)[0] == ["data.mix.1.source: 'b' -> 'c'"]


def _sft(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    data = {
        "model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(out), "layout": "d1",
        "global_batch_size": 4, "steps": 2, "save_every": 1, "progress": False, "export_hf_at_end": False,
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-3}},
    }  # fmt: skip
    cls = TRAINERS.get("sft").config_cls
    return TRAINERS.get("sft").run(build_config(cls, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()])))


@pytest.mark.usefixtures("_single_process")
def test_resume_refuses_another_experiment_and_allows_harmless_changes(
    assets: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _sft(assets, tmp_path)
    with pytest.raises(ResumeConfigMismatch) as info:
        _sft(assets, tmp_path, steps=3, **{"engine.optimizer.lr": 5e-3})
    message = str(info.value)
    assert "engine.optimizer.lr: 0.001 -> 0.005" in message
    assert "resume=never" in message and "resume=force" in message and "output_dir" in message
    assert "steps" not in message.split("experiment:")[1].split(". Start")[0]  # steps is not the problem

    with caplog.at_level(logging.WARNING):
        summary = _sft(assets, tmp_path, steps=3, log_every=2)  # harmless: allowed, and listed
    assert summary["resumed_from"] == 2
    assert any("changed settings" in r.getMessage() and "log_every: 1 -> 2" in r.getMessage() for r in caplog.records)

    summary = _sft(assets, tmp_path, steps=4, resume="force", **{"engine.optimizer.lr": 5e-3})
    assert summary["resumed_from"] == 3
    assert json.loads((tmp_path / "config.json").read_text())["engine"]["optimizer"]["lr"] == 5e-3
    summary = _sft(assets, tmp_path, steps=1, resume="never", **{"engine.optimizer.lr": 2e-3})
    assert "resumed_from" not in summary


def test_a_yaml_syntax_error_names_the_file_and_the_place(tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import load_yaml

    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nengine: {lr: [1, 2}\n")
    with pytest.raises(ValueError, match=rf"config file '{bad}' is not valid YAML at line 2, column 19"):
        load_yaml(bad)


def test_an_output_dir_that_cannot_be_created_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"cannot be created .*choose another output_dir"):
        OutputDirLock(blocker / "run").acquire()
