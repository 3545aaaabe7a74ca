"""GRPO with streaming rollouts (``streaming_rollouts: true``, issue 41) in real trainer runs on the tiny model:

- ``max_staleness=0`` trains on the synchronous batches: the same per-step losses and rewards and final weights as
  ``async_rollouts=false``, in one process and on 2 ranks (FSDP, gloo);
- ``max_staleness=1``: no trained group is more than 1 step stale (``stream/*`` metrics and the per-rank records),
  every trained batch is whole groups, and a run stopped after step 2 and resumed trains every prompt position
  exactly once (its in-flight and finished-unused prompts are in the checkpoint); the same for a ``shardforge
  train grpo`` process killed with SIGKILL at some point after its step-2 checkpoint;
- dynamic sampling drops each group with equal rewards as it finishes; every step still trains on whole groups
  with a learning signal, and every prompt position is trained or dropped once;
- with partial rollouts (chunked generation that a weight update interrupts): ``max_staleness=0`` still equals
  synchronous (1 and 2 ranks); at ``max_staleness=1`` the bound, whole groups, per-token staleness and a lossless
  resume hold, and with a deterministic interruption every later group keeps its start version while its later
  tokens come from the newer policy (``partial/*``, rollout correction);
- the settings streaming does not support yet are refused with one line (ReMax streams:
  test_alg_grpo_streaming_remax.py).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.algorithms.testing.streaming_runs import (
    check_lossless_stream,
    die_after_checkpoint_then_resume,
    interrupt_every_later_call,
)
from shardforge.algorithms.trainers.rl.streaming_source import StreamingSource

STEPS, PROMPTS, GROUP = 3, 4, 4
STREAM = {"async_rollouts": True, "streaming_rollouts": True}
PARTIAL = {"rollout.partial_rollouts": True, "rollout.interrupt_chunk_tokens": 2}
REWARDS = textwrap.dedent(
    """
    def has_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)


    def only_seven(prompt, response, reference):
        return float("7" in response)
    """
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("grpo_streaming")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=4, data_seed=2)
    (root / "streaming_rewards_mod.py").write_text(REWARDS)
    return {"root": str(root), "model": str(root / "model"), "train": str(tiny["train"]), "eval": str(tiny["eval"])}


def _config(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    data = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": "d1",
        "steps": STEPS, "prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": 4, "progress": False,
        "reward_fn": "streaming_rewards_mod:has_seven", "save_every": 0, "resume": "never", "export_hf_at_end": True,
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-2, "eps": 1e-6}},
    }  # fmt: skip
    return build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _records(out: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / name).read_text().splitlines() if line]


def _run(assets: dict[str, Any], out: Path, **overrides: Any) -> dict[str, Any]:
    """Train (on every rank of a pool, or here); rank 0 returns the train metrics and the exported weights, every
    rank the group sizes of each batch it trained on."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from shardforge.algorithms.trainers import grpo

    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])
    groups: list[list[int]] = []
    train_step = grpo._train_step

    def counting(sampled: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        groups.append(sorted(Counter(t.group for t in sampled.rollouts).values()))
        return train_step(sampled, *args, **kwargs)

    grpo._train_step = counting  # type: ignore[assignment]
    try:
        grpo.run_grpo(_config(assets, out, **overrides))
    finally:  # the pool's processes serve later tests
        grpo._train_step = train_step  # type: ignore[assignment]
    if dist.is_initialized() and dist.get_rank() != 0:
        return {"groups": groups}
    weights: dict[str, torch.Tensor] = {}
    for path in sorted((out / "hf").glob("*.safetensors")):
        weights |= load_file(str(path))
    train = [r for r in _records(out) if r["split"] == "train"]
    return {"train": train, "weights": weights, "groups": groups}


@pytest.fixture(scope="module")
def sync_d1(assets: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(assets, tmp_path_factory.mktemp("sync_d1"))


# Streaming generates one group per generate call, the synchronous trainer the whole batch in one: the same token ids
# (per-request seeds), log-probs equal up to float rounding of the batch rows; and the streaming (asynchronous) loss
# recomputes the old log-probs instead of reusing the training forward's. Measured: loss to 4e-8 relative, weights 0.
LOSS_REL, WEIGHT_TOL = 1e-5, 2e-5


def _assert_same_as_sync(sync: dict[str, Any], stream: dict[str, Any]) -> None:
    assert [r["step"] for r in stream["train"]] == list(range(1, STEPS + 1))
    for a, b in zip(sync["train"], stream["train"], strict=True):
        for key in ("reward_mean", "reward_std", "response_len_mean"):  # the same samples (sums over 2 ranks: rounding)
            assert b[key] == pytest.approx(a[key], rel=1e-12), (a["step"], key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=LOSS_REL, abs=1e-8), (a["step"], key, a[key], b[key])
        assert b["stream/staleness_max"] == 0.0 and b["stream/staleness_0_frac"] == 1.0
        assert b["stream/version_spread"] == 0.0 and b["stream/regenerated"] == 0.0
    assert sync["weights"].keys() == stream["weights"].keys() and sync["weights"]
    worst = max(float((sync["weights"][k] - stream["weights"][k]).abs().max()) for k in sync["weights"])
    assert worst <= WEIGHT_TOL, worst


def test_streaming_staleness_zero_equals_synchronous(
    assets: dict[str, Any], sync_d1: dict[str, Any], tmp_path: Path
) -> None:
    stream = _run(assets, tmp_path / "s0", max_staleness=0, **STREAM)
    _assert_same_as_sync(sync_d1, stream)
    assert stream["groups"] == [[GROUP] * PROMPTS] * STEPS


def test_streaming_with_partial_rollouts_at_staleness_zero_equals_synchronous(
    assets: dict[str, Any], sync_d1: dict[str, Any], tmp_path: Path
) -> None:
    # Nothing is published while a group generates (s=0), so chunked generation samples what one call would.
    stream = _run(assets, tmp_path / "p0", max_staleness=0, **STREAM, **PARTIAL)
    _assert_same_as_sync(sync_d1, stream)
    assert all(
        r["partial/interrupted_frac"] == 0.0 and r["partial/token_staleness_max"] == 0.0 for r in stream["train"]
    )


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
def test_streaming_staleness_zero_on_two_ranks_equals_synchronous(
    assets: dict[str, Any], sync_d1: dict[str, Any], tmp_path: Path, partial: bool
) -> None:
    from shardforge.mesh.testing import get_rank_pool

    # FSDP 2: each rank streams its half of every batch (global positions rank, rank + 2) with the same seeds.
    extra = PARTIAL if partial else {}
    runs = get_rank_pool(2).run(
        _run, assets, tmp_path / "d2", layout="d2", max_staleness=0, **STREAM, **extra, timeout_s=240
    )
    _assert_same_as_sync(sync_d1, runs[0])
    assert all(run["groups"] == [[GROUP] * (PROMPTS // 2)] * STEPS for run in runs)
    records = [_records(tmp_path / "d2" / "streaming", f"rank{r}.jsonl") for r in range(2)]
    for step in range(STEPS):  # rank r trains global positions r, r + 2 of batch `step`: the synchronous split
        assert [records[r][step]["positions"] for r in range(2)] == [
            [4 * step, 4 * step + 2],
            [4 * step + 1, 4 * step + 3],
        ]


def test_streaming_bound_complete_groups_and_lossless_resume(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardforge.algorithms.trainers.grpo import GRPOTrainer

    out, steps, cut = tmp_path / "s1", 5, 2
    overrides = {"max_staleness": 1, "steps": steps, "save_every": cut, "resume": "auto", **STREAM}
    _, resumed = die_after_checkpoint_then_resume(GRPOTrainer, lambda: _run(assets, out, **overrides), cut, monkeypatch)
    records = _records(out / "streaming", "rank0.jsonl")
    check_lossless_stream(records, steps, PROMPTS, cut)
    for r in records:
        assert sorted(r["finish_order"]) == r["positions"]
    assert resumed["groups"] == [[GROUP] * PROMPTS] * (steps - cut), "whole groups only"
    train = [r for r in _records(out) if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert r["stream/staleness_max"] <= 1.0 and r["staleness"] <= 1.0, r
        assert 0.0 <= r["stream/trainer_idle_frac"] <= 1.0 and r["stream/in_flight"] >= 0.0
        assert r["stream/staleness_0_frac"] + r["stream/staleness_1_frac"] == pytest.approx(1.0)
    assert any(r["stream/staleness_1_frac"] > 0 for r in train), "the generator ran ahead of the trainer"


def test_streaming_with_partial_rollouts_bound_complete_groups_and_lossless_resume(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardforge.algorithms.trainers.grpo import GRPOTrainer

    # A group interrupted mid-generation at the checkpoint is regenerated from scratch by the resumed run (streaming.py,
    # "Checkpoints"): every position is still trained exactly once, none more than 1 version stale.
    out, steps, cut = tmp_path / "p1", 5, 2
    overrides = {"max_staleness": 1, "steps": steps, "save_every": cut, "resume": "auto", "max_new_tokens": 8}
    run = lambda: _run(assets, out, **overrides, **STREAM, **PARTIAL)  # noqa: E731
    _, resumed = die_after_checkpoint_then_resume(GRPOTrainer, run, cut, monkeypatch)
    check_lossless_stream(_records(out / "streaming", "rank0.jsonl"), steps, PROMPTS, cut)
    assert resumed["groups"] == [[GROUP] * PROMPTS] * (steps - cut), "whole groups only"
    train = [r for r in _records(out) if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:  # no token older than its group's start version: the per-token lag is bounded the same way
        assert r["stream/staleness_max"] <= 1.0 and 0.0 <= r["partial/token_staleness_max"] <= 1.0, r
        assert 0.0 <= r["partial/interrupted_frac"] <= 1.0 and 0.0 <= r["partial/fresher_token_frac"] <= 1.0, r


def test_streaming_with_partial_rollouts_continues_groups_under_the_new_policy(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every call after the first generates its first chunk under policy k - 1 and the rest under policy k (the gate),
    # so batch k (k >= 1) holds groups that started under k - 1 (staleness 1) whose later tokens are on-policy.
    gate = interrupt_every_later_call(StreamingSource._between_chunks)
    monkeypatch.setattr(StreamingSource, "_between_chunks", gate)
    steps, out = 4, tmp_path / "gated"
    train = _run(assets, out, max_staleness=1, steps=steps, max_new_tokens=8, **STREAM, **PARTIAL)["train"]
    records = _records(out / "streaming", "rank0.jsonl")
    assert [r["start_versions"] for r in records] == [[0] * PROMPTS] + [[k - 1] * PROMPTS for k in range(1, steps)]
    assert train[0]["partial/interrupted_frac"] == 0.0 and train[0]["partial/token_staleness_max"] == 0.0
    for r in train[1:]:
        assert r["stream/staleness_mean"] == 1.0 and r["partial/token_staleness_max"] == 1.0, r
        assert r["partial/interrupted_frac"] > 0.0 and r["partial/fresher_token_frac"] > 0.0, r
        assert r["partial/token_staleness_mean"] < 1.0, "tokens after the first chunk came from the newer policy"
        assert math.isfinite(r["loss"]) and r["rollout_corr/kl_k1"] != 0.0, r


def test_streaming_run_killed_with_sigkill_resumes_without_dropping_or_repeating_a_prompt(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    """The CLI process dies by SIGKILL wherever it is after the step-2 checkpoint (generating, training, writing
    the next checkpoint); the rerun of the same command resumes from the newest committed checkpoint, and the
    batches it records cover every prompt position exactly once."""
    import os
    import signal
    import subprocess
    import time

    import yaml

    steps, every = 8, 2
    out = tmp_path / "killed"
    config = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": "d1",
        "steps": steps, "prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": 4, "progress": False,
        "reward_fn": "streaming_rewards_mod:has_seven", "save_every": every, "resume": "auto", "max_staleness": 1,
        "async_rollouts": True, "streaming_rollouts": True, "export_hf_at_end": False,
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-2, "eps": 1e-6}},
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", "c.yaml"]
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([assets["root"], os.environ.get("PYTHONPATH", "")])
    )
    first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    committed = out / "checkpoints" / f"step_{every:08d}" / "COMMITTED"
    deadline = time.time() + 300
    while not committed.exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, "the run ended before it could be killed: " + first.stderr.read().decode()[-2000:]
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr + second.stdout
    records = _records(out / "streaming", "rank0.jsonl")
    assert [r["batch"] for r in records] == list(range(steps))
    positions = [p for r in records for p in r["positions"]]
    assert sorted(positions) == list(range(steps * PROMPTS)), "every prompt position trained exactly once"
    train = [r for r in _records(out) if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1)), [r["step"] for r in train]
    assert all(r["stream/staleness_max"] <= 1.0 for r in train)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"streaming_rollouts": True},
            "streaming_rollouts=true is a mode of asynchronous rollouts: set async_rollouts",
        ),
        ({**STREAM, "rollout.streaming_workers": 0}, r"rollout.streaming_workers=0 must be >= 1 \(generator threads"),
        ({"rollout.streaming_workers": 2}, "streaming_workers=2 sets the generator threads of streaming rollouts: set"),
        (
            {**STREAM, "rollout.streaming_workers": 2},
            "streaming_workers=2 needs a rollout engine that serves concurrent",
        ),
        (
            {
                **STREAM,
                "rollout.engine": "vllm",
                "rollout.streaming_workers": 2,
                "rollout.vllm": {"mode": "server", "on_server_failure": "restart"},
            },
            "on_server_failure=restart with rollout.streaming_workers=2 is not supported yet",
        ),
    ],
)
def test_streaming_refuses_what_it_does_not_support(
    assets: dict[str, Any], tmp_path: Path, overrides: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _config(assets, tmp_path, **overrides)


def test_asynchronous_rollouts_with_several_ranks_need_an_engine_per_rank_or_per_call_versions(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    from shardforge.algorithms.trainers.rl.streaming_checks import check_streaming_layout

    check_streaming_layout(_config(assets, tmp_path, **STREAM, **{"rollout.engine": "vllm"}), 1)
    each = {"rollout.engine": "vllm", "rollout.vllm.placement": "each_rank"}
    check_streaming_layout(_config(assets, tmp_path, **STREAM, **each), 2)
    # the embedded-HF Ray actors, shared by the ranks: each call names its disk version (integration_tests/test_ray_launch.py)
    check_streaming_layout(_config(assets, tmp_path, **STREAM, **{"rollout.placement": "disaggregated"}), 2)
    # a vLLM server the trainer starts (or reaches by server_url), shared by the ranks: its version gate
    # (test_rollout_server_version_gate.py), streamed or whole batches
    server = {"rollout.engine": "vllm", "rollout.vllm.mode": "server"}
    check_streaming_layout(_config(assets, tmp_path, **STREAM, **server), 2)
    check_streaming_layout(_config(assets, tmp_path, async_rollouts=True, **server), 2)
    url = {"rollout.engine": "vllm", "rollout.vllm": {"mode": "server", "server_url": "http://127.0.0.1:1"}}
    check_streaming_layout(_config(assets, tmp_path, **STREAM, **url), 2)
    check_streaming_layout(_config(assets, tmp_path, **server), 2)  # synchronous: collective switches
    for async_mode in (STREAM, {"async_rollouts": True}):
        with pytest.raises(ValueError, match=r"with 2 ranks and rollout\.vllm\.placement=rank0 is not supported"):
            check_streaming_layout(_config(assets, tmp_path, **async_mode, **{"rollout.engine": "vllm"}), 2)
    restart = {"rollout.engine": "vllm", "rollout.vllm": {"mode": "server", "on_server_failure": "restart"}}
    for async_mode in (STREAM, {"async_rollouts": True}):
        with pytest.raises(ValueError, match="with 2 ranks on one vLLM server") as error:
            check_streaming_layout(_config(assets, tmp_path, **async_mode, **restart), 2)
        assert str(error.value).endswith("set rollout.vllm.on_server_failure=error")
        check_streaming_layout(_config(assets, tmp_path, **async_mode, **restart), 1)  # one rank: nothing shared


def test_streaming_workers_with_an_engine_that_serves_concurrent_requests(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    server = {"rollout.engine": "vllm", "rollout.vllm.mode": "server", "rollout.streaming_workers": 4}
    assert _config(assets, tmp_path, **STREAM, **server).rollout.streaming_workers == 4
    actors = {"rollout.placement": "disaggregated", "rollout.streaming_workers": 2}
    assert _config(assets, tmp_path, **STREAM, **actors).rollout.streaming_workers == 2
    assert _config(assets, tmp_path).rollout.streaming_workers == 1  # the default: one generator thread


def test_streaming_dynamic_sampling_trains_only_groups_with_a_signal(assets: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "ds"
    ds = {
        "dynamic_sampling.enabled": True,
        "dynamic_sampling.max_rounds": 4,
        "reward_fn": "streaming_rewards_mod:only_seven",
    }
    run = _run(assets, out, max_staleness=1, **STREAM, **ds)
    records = _records(out / "streaming", "rank0.jsonl")
    trained = [p for r in records for p in r["positions"]]
    filtered = [p for r in records for p in r["filtered"]]
    assert filtered, "some groups had equal rewards (0/1 reward, 4 samples)"
    assert sorted(trained + filtered) == list(range(len(trained) + len(filtered))), "each position once, none lost"
    train = run["train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert r["stream/staleness_max"] <= 1.0
        if r["stream/cap_hit_frac"] == 0.0:  # a full batch of kept groups: every one has a learning signal
            assert r["advantage_nonzero_frac"] == pytest.approx(1.0), r
    assert train[-1]["stream/filtered_all_fail"] + train[-1]["stream/filtered_all_pass"] == len(filtered)
