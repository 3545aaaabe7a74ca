"""Two "nodes" on one machine (issue 21): two `shardforge train` commands, each ``--nnodes 2
--node-rank 0/1 --nproc-per-node 1``, meet at a c10d rendezvous on 127.0.0.1 and reproduce the
single-node run at the same world size (2 ranks): the same loss curve and the same final weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from shardforge.algorithms.testing import tiny_assets
from shardforge.algorithms.testing.fault_injection import fault_env

ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
for _var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_var, None)
CLI = [sys.executable, "-m", "shardforge.algorithms.cli"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("multinode"), max_operand=9, num_eval=10)


def _free_port() -> int:
    from shardforge.mesh import free_port  # below the ephemeral range: parallel tests cannot take it meanwhile

    return free_port()


def _config(tmp_path: Path, assets, name: str, **entries) -> Path:
    data = {
        "model": str(assets["model"]),
        "train_file": str(assets["train"]),
        "output_dir": str(tmp_path / name),  # shared by both "nodes", as on shared storage
        "global_batch_size": 4,
        "steps": 4,
        "progress": False,
        "engine": {"max_tokens_per_microbatch": 64},
    } | entries
    data = {key: value for key, value in data.items() if value is not None}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_node(
    algorithm: str, config: Path, rank: int, endpoint: str, nproc: int = 1, extra: tuple[str, ...] = (), env=None
) -> subprocess.Popen:
    command = [*CLI, "train", algorithm, "--config", str(config), "--nproc-per-node", str(nproc), "--nnodes", "2",
               "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--rdzv-conf", "join_timeout=120", *extra]  # fmt: skip
    return subprocess.Popen(command, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_two_nodes(
    algorithm: str, config: Path, nproc: int = 1, attempts: int = 3, extra: tuple[str, ...] = (), env=None
) -> list[str]:
    """Start node 1 then node 0 on a fresh port; a port taken in between (rare) is retried on another."""
    for _ in range(attempts):
        endpoint = f"127.0.0.1:{_free_port()}"
        nodes = [start_node(algorithm, config, rank, endpoint, nproc, extra, env) for rank in (1, 0)]
        try:
            errors = [node.communicate(timeout=300)[1] for node in nodes]
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
        if all(node.returncode == 0 for node in nodes):
            return errors
        if not any("rendezvous" in err and "Address already in use" in err for err in errors):
            break
    raise AssertionError("\n---\n".join(f"node exit {n.returncode}:\n{e[-3000:]}" for n, e in zip(nodes, errors)))


def _train_losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if r.get("split") == "train"]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted((out / "hf").glob("*.safetensors")):
        tensors |= load_file(path)
    assert tensors, f"no exported weights under {out / 'hf'}"
    return tensors


def assert_same_run(single: Path, multi: Path, steps: int) -> None:
    reference, curve = _train_losses(single), _train_losses(multi)
    assert [s for s, _ in curve] == [s for s, _ in reference] == list(range(1, steps + 1))
    for (step, expected), (_, got) in zip(reference, curve):
        assert abs(got - expected) <= 1e-5 * abs(expected), (step, got, expected)
    ref_weights, weights = _weights(single), _weights(multi)
    assert ref_weights.keys() == weights.keys()
    for name, tensor in ref_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert (
        json.loads((multi / "summary.json").read_text())["layout"]
        == json.loads((single / "summary.json").read_text())["layout"]
    )


def _run_sft_on_rank(config_path: str) -> dict:
    import torch.distributed as dist

    from shardforge.algorithms.config_io import build_config, load_yaml
    from shardforge.algorithms.trainers.sft import SFTConfig, run_sft

    summary = run_sft(build_config(SFTConfig, load_yaml(config_path)))
    return summary if dist.get_rank() == 0 else {}


@pytest.mark.heavy  # heavy (~50 s, 93 s under load): CI keeps the two-node preflight launch and the torchrun flags
def test_two_node_sft_reproduces_the_single_node_run(tmp_path, assets):
    """The reference is the same config on one node's 2 ranks (the shared rank pool: what
    `shardforge train sft --nproc-per-node 2` runs on each rank, without a second CLI start-up)."""
    from shardforge.mesh.testing import get_rank_pool

    single = _config(tmp_path, assets, "single")
    get_rank_pool(2).run(_run_sft_on_rank, str(single), timeout_s=300)
    run_two_nodes("sft", _config(tmp_path, assets, "multi"))
    assert_same_run(tmp_path / "single", tmp_path / "multi", steps=4)
    # global rank 1 ran in the node-rank-1 command: each rank logged its own line
    assert "rank 1 of 2" in (tmp_path / "multi" / "logs" / "rank1.log").read_text()


def test_preflight_checks_the_global_world_on_every_node_before_the_rendezvous(tmp_path, assets):
    """layout=d4 needs 4 ranks; two nodes of one rank have 2 (one node alone would have 1): each
    node's command refuses in one line at once, neither waits for the other at the rendezvous."""
    config = _config(tmp_path, assets, "bad", layout="d4")
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [start_node("sft", config, rank, endpoint) for rank in (0, 1)]
    errors = [node.communicate(timeout=300)[1] for node in nodes]
    for node, err in zip(nodes, errors):
        lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]
        assert node.returncode == 1 and lines and lines[-1].startswith("shardforge: error: "), err
        assert "needs 4 ranks" in lines[-1] and "is 2" in lines[-1] and "Traceback" not in err, err


@pytest.mark.heavy  # heavy (~86 s, 260 s on a loaded machine): the two-node SFT test runs the same rendezvous
def test_two_node_grpo_reproduces_the_single_node_run(tmp_path, assets):
    """Rollouts (seeded per rank), rewards, advantages and updates: the same whichever node a rank is on.
    The reward is the response length: an untrained model scores 0 on exact match everywhere, which would
    make every advantage, loss and update 0 and the comparison empty."""
    (tmp_path / "length_reward.py").write_text(
        "def reward(prompt, response, reference):\n    return float(len(response))\n"
    )
    env = dict(ENV, PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path), ENV.get("PYTHONPATH", "")) if p))
    rl = {"global_batch_size": None, "steps": 3, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3,
          "reward_fn": "length_reward:reward"}  # fmt: skip
    single = _config(tmp_path, assets, "single", **rl)
    result = subprocess.run([*CLI, "train", "grpo", "--config", str(single), "--nproc-per-node", "2"],
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_two_nodes("grpo", _config(tmp_path, assets, "multi", **rl), env=env)
    assert_same_run(tmp_path / "single", tmp_path / "multi", steps=3)
    assert any(loss != 0.0 for _, loss in _train_losses(tmp_path / "single")), "the run must train something"


@pytest.mark.heavy  # heavy (~95 s): restart end to end; CI keeps the flags (test_alg_multinode_args) and resume-after-kill (test_checkpoint_resume)
def test_a_killed_rank_restarts_every_rank_on_both_nodes_and_resumes(tmp_path, assets):
    """--max-restarts 1: rank 1 (node 1) is SIGKILLed after step 3; both agents restart their ranks,
    which resume from the step-2 checkpoint; the finished run equals an uninterrupted one."""
    steps = {"steps": 6, "save_every": 2}
    single = _config(tmp_path, assets, "single", **steps)
    result = subprocess.run([*CLI, "train", "sft", "--config", str(single), "--nproc-per-node", "2"],
                            env=ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    marker = tmp_path / "killed-once"
    env = ENV | fault_env(SHARDFORGE_FAULT_KILL=f"1:3:{marker}")
    run_two_nodes("sft", _config(tmp_path, assets, "multi", **steps), extra=("--max-restarts", "1"), env=env)
    assert marker.read_text() == "killed rank 1 after step 3\n"  # the kill happened
    summary = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert summary["resumed_from"] == 2, summary
    assert_same_run(tmp_path / "single", tmp_path / "multi", steps=6)
