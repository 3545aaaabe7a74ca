"""`shardforge train grpo --launcher ray` (issue 21): the 2 ranks as Ray actors in a placement group on
a local CPU Ray cluster reproduce the torchrun run (same rollouts from the same seeds, so the same
losses and weights), and a failing rank ends the run with its one-line error. Run by `nox -s ray`;
skipped where Ray is not installed.
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

pytest.importorskip("ray")

from shardforge.algorithms.testing import tiny_assets
from shardforge.algorithms.testing.fault_injection import fault_env

ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
for _var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
    ENV.pop(_var, None)
ENV["RAY_USAGE_STATS_ENABLED"] = "0"
CLI = [sys.executable, "-m", "shardforge.algorithms.cli"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("ray"), max_operand=9, num_eval=10)


# The untrained tiny model never answers right (exact_match would be 0 everywhere, so every advantage and
# loss 0): reward the response length, so advantages, losses and updates are non-zero and must match.
LENGTH_REWARD = "def reward(prompt, response, reference):\n    return float(len(response))\n"


def _config(tmp_path: Path, assets, name: str, **entries) -> Path:
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    data = {
        "model": str(assets["model"]),
        "train_file": str(assets["train"]),
        "output_dir": str(tmp_path / name),
        "steps": 3,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_new_tokens": 4,
        "reward_fn": "length_reward:reward",
        "progress": False,
        "engine": {"max_tokens_per_microbatch": 64},
    } | entries
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _env(config: Path) -> dict[str, str]:
    """ENV with the reward module importable (by the driver and, inherited, by Ray's workers)."""
    return ENV | {"PYTHONPATH": os.pathsep.join(filter(None, [str(config.parent), ENV.get("PYTHONPATH")]))}


def _train(config: Path, *launch: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "train", "grpo", "--config", str(config), "--nproc-per-node", "2", *launch],
                          env=_env(config), capture_output=True, text=True, timeout=900)  # fmt: skip


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("split") == "train"]


def _weights(hf_dir: Path) -> dict:
    tensors: dict = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors |= load_file(path)
    assert tensors, f"no exported weights under {hf_dir}"
    return tensors


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory, assets) -> Path:
    """The reference: the same GRPO under torchrun (2 ranks, colocated rollouts); its output directory."""
    tmp_path = tmp_path_factory.mktemp("torchrun")
    torchrun = _train(_config(tmp_path, assets, "torchrun"))
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    return tmp_path / "torchrun"


def assert_same_run(reference_dir: Path, run_dir: Path) -> list[dict]:
    """Same rollouts and rewards, same losses and updates, same final weights; returns ``run_dir``'s curve."""
    reference, curve = _metrics(reference_dir), _metrics(run_dir)
    assert [r["step"] for r in curve] == [r["step"] for r in reference] == [1, 2, 3]
    assert any(r["loss"] != 0.0 for r in reference), reference  # the comparison is not vacuous
    for expected, got in zip(reference, curve):
        # the same rollouts (seeded per request) and rewards ...
        assert got["response_len_mean"] == expected["response_len_mean"], (got, expected)
        assert got["reward_mean"] == expected["reward_mean"], (got, expected)
        # ... so the same losses and updates
        for key in ("loss", "grad_norm", "actor/entropy"):
            assert abs(got[key] - expected[key]) <= 1e-6 * abs(expected[key]), (key, got[key], expected[key])
    weights = [_weights(path / "hf") for path in (reference_dir, run_dir)]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    return curve


def test_grpo_under_ray_reproduces_the_torchrun_run(tmp_path, assets, torchrun_run):
    ray_run = _train(_config(tmp_path, assets, "ray"), "--launcher", "ray")
    assert ray_run.returncode == 0, (ray_run.stdout[-3000:], ray_run.stderr[-3000:])
    assert_same_run(torchrun_run, tmp_path / "ray")
    # both ranks ran under Ray and logged their own line; the summary records the same layout
    assert "rank 1 of 2" in (tmp_path / "ray" / "logs" / "rank1.log").read_text()
    summaries = [json.loads((path / "summary.json").read_text()) for path in (torchrun_run, tmp_path / "ray")]
    assert summaries[0]["layout"] == summaries[1]["layout"]


def test_a_stuck_rank_under_ray_ends_the_run_with_the_one_line_timeout_error(tmp_path, assets):
    """Rank 1 sleeps 400 s in step 2 (SHARDFORGE_FAULT_SLEEP, forwarded to the actors): rank 0's collective
    times out after 4 s, its one-line error (naming rank 1's frame) is the command's, rank 1 is killed."""
    config = _config(tmp_path, assets, "stuck", engine={"max_tokens_per_microbatch": 64, "dist_timeout_s": 4})
    env = _env(config) | fault_env(SHARDFORGE_FAULT_SLEEP="1:2:400")
    result = subprocess.run([*CLI, "train", "grpo", "--config", str(config), "--nproc-per-node", "2", "--launcher",
                             "ray"], env=env, capture_output=True, text=True, timeout=350)  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardforge")]
    assert result.returncode == 1 and lines, (result.stdout[-3000:], result.stderr[-3000:])
    assert lines[-1].startswith("shardforge: error: rank 0: a collective timed out after 4 s"), lines[-1]
    assert "rank 1 in step 2 at sleep_if_requested" in lines[-1], lines[-1]


def test_preflight_refuses_a_bad_layout_before_any_actor_starts(tmp_path, assets):
    result = _train(_config(tmp_path, assets, "bad", layout="d4"), "--launcher", "ray")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and lines[-1].startswith("shardforge: error: "), result.stderr[-3000:]
    assert "needs 4 ranks" in lines[-1] and "Traceback" not in result.stderr, lines[-1]


def _rollout_actor_stats(output: str) -> list[dict]:
    """The driver's ``ray: rollout actor {...}`` lines (what each rollout actor served)."""
    prefix = "ray: rollout actor "
    return [json.loads(line.split(prefix, 1)[1]) for line in output.splitlines() if prefix in line]


def test_disaggregated_rollout_actor_reproduces_the_colocated_run(tmp_path, assets, torchrun_run):
    """rollout.placement=disaggregated: 2 trainer actors generate through 1 rollout actor (the embedded HF engine
    in an actor of its own), which gets every new version over the collective transport. Sampling is seeded per
    request, so the run is the colocated run (torchrun; the Ray colocated run equals it, test above) step for step:
    the same rollouts, rewards, losses and final weights."""
    config = _config(tmp_path, assets, "disagg", **{"rollout.placement": "disaggregated", "rollout.num_actors": 1})
    result = _train(config, "--launcher", "ray")
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    curve = assert_same_run(torchrun_run, tmp_path / "disagg")
    assert all("reward_mean" in row and "reward_std" in row for row in curve)
    stats = _rollout_actor_stats(result.stdout + result.stderr)
    assert len(stats) == 1, (result.stdout[-3000:], result.stderr[-3000:])
    # the initial publish (v1) and one per step, each verified and applied on the actor, in order ...
    assert stats[0]["received"] == [1, 2, 3, 4] and stats[0]["version"] == 4, stats
    # ... and step k's rollouts (2 prompts x 2 samples) came from version k, generated on the actor
    for version in (1, 2, 3):
        assert stats[0]["rollouts_by_version"][str(version)] >= 4, stats
    assert stats[0]["generate_calls"] >= 6, stats  # 3 steps x 2 ranks (+ held-out evaluation)


def test_a_dead_rollout_actor_is_dropped_and_the_run_is_the_healthy_run(tmp_path, assets, torchrun_run):
    """rollout.on_actor_failure=drop, 2 HF rollout actors for the 2 ranks: actor 1 kills itself (SIGKILL) in its second
    generate call, rank 1's request of step 2 in flight (SHARDFORGE_FAULT_KILL_ROLLOUT). The ranks drop it at the end
    of the round, rank 1 generates its whole round again on actor 0 (same version, same seeds), and rank 0 publishes
    the later versions to actor 0 alone: the run finishes and is the healthy (torchrun) run step for step."""
    config = _config(tmp_path, assets, "drop", **{"rollout.placement": "disaggregated", "rollout.num_actors": 2},
                     **{"rollout.on_actor_failure": "drop"})  # fmt: skip
    env = _env(config) | fault_env(SHARDFORGE_FAULT_KILL_ROLLOUT="1:2") | {"RAY_agent_register_timeout_ms": "300000"}
    result = subprocess.run([*CLI, "train", "grpo", "--config", str(config), "--nproc-per-node", "2", "--launcher",
                             "ray"], env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    curve = assert_same_run(torchrun_run, tmp_path / "drop")
    assert [row["rollout_actors/dropped"] for row in curve] == [0.0, 1.0, 0.0], curve
    assert [row["rollout_actors/live"] for row in curve] == [2.0, 1.0, 1.0], curve
    resent = [row["rollout_actors/resent_requests"] for row in curve]
    assert resent[0] == resent[2] == 0.0 and resent[1] >= 1.0, curve  # rank 1's round of step 2, again
    log = (tmp_path / "drop" / "logs" / "rank0.log").read_text()
    assert (
        "dropping rollout actor(s) shardforge-rollout-1 from the pool: rollout actor shardforge-rollout-1 died" in log
    )
    stats = _rollout_actor_stats(result.stdout + result.stderr)
    assert [s["index"] for s in stats] == [0], stats  # the dead actor answers nothing
    # actor 0 got every version (the initial one and one per step), the last ones in a group without actor 1
    assert stats[0]["received"] == [1, 2, 3, 4] and stats[0]["version"] == 4, stats


STREAM = {"async_rollouts": True, "streaming_rollouts": True, "rollout.placement": "disaggregated",
          "rollout.num_actors": 1}  # fmt: skip


def _stream_records(out: Path) -> list[list[dict]]:
    return [[json.loads(line) for line in (out / "streaming" / f"rank{r}.jsonl").read_text().splitlines()]
            for r in range(2)]  # fmt: skip


def test_streaming_on_a_shared_hf_rollout_actor_at_staleness_zero_is_the_synchronous_run(
    tmp_path, assets, torchrun_run
):
    """Issue 41: both trainer ranks stream their own prompts through one HF rollout actor; every call names the disk
    version it needs and the actor loads it first (one call at a time). At max_staleness 0 every group is generated by
    the policy that trains on it, so the run is the synchronous one (the torchrun run, which the synchronous
    disaggregated run reproduces, above): the same samples and rewards, losses to float rounding (streaming recomputes
    the old log-probs, tests/test_alg_grpo_streaming.py), the same weights."""
    config = _config(tmp_path, assets, "stream0", max_staleness=0, **STREAM)
    result = _train(config, "--launcher", "ray")
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    reference, curve = _metrics(torchrun_run), _metrics(tmp_path / "stream0")
    assert [r["step"] for r in curve] == [1, 2, 3]
    for expected, got in zip(reference, curve):
        for key in ("reward_mean", "reward_std", "response_len_mean"):
            assert got[key] == pytest.approx(expected[key], rel=1e-12), (key, got, expected)
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-8), (key, got[key], expected[key])
        assert got["stream/staleness_max"] == 0.0 and got["stream/regenerated"] == 0.0, got
    weights = [_weights(path / "hf") for path in (torchrun_run, tmp_path / "stream0")]
    worst = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    assert worst <= 2e-5, worst
    for rank, records in enumerate(_stream_records(tmp_path / "stream0")):
        # rank r streams global position 2 * batch + r, the synchronous split, at staleness 0
        assert [(r["positions"], r["start_versions"]) for r in records] == [([2 * b + rank], [b]) for b in range(3)]
    (stats,) = _rollout_actor_stats(result.stdout + result.stderr)
    # no collective transfer: every version the ranks' calls named was loaded from disk, once, in order
    assert stats["received"] == [] and stats["loaded"] == sorted(set(stats["loaded"])), stats
    assert len(stats["loaded"]) >= 3 and stats["served_newer"] == 0, stats


PARTIAL = {"rollout.partial_rollouts": True, "rollout.interrupt_chunk_tokens": 2, "max_new_tokens": 8}


@pytest.mark.parametrize(
    ("streaming", "partial"), [(True, False), (False, False), (True, True)], ids=["streaming", "async", "partial"]
)
def test_asynchronous_rollouts_on_a_shared_hf_rollout_actor_keep_the_staleness_bound(
    tmp_path, assets, streaming, partial
):
    """max_staleness 1, 2 ranks on one HF rollout actor: every batch is whole groups (each rank's own prompt), no group
    is more than one version stale, every prompt position is trained once, and the actor loaded the versions the
    calls named from disk (streaming: the group records; async: whole batches one step ahead; partial: streaming
    whose calls the actor continues under newer versions between chunks, no token more than one version stale)."""
    entries = STREAM | {"streaming_rollouts": streaming, "max_staleness": 1, "steps": 4} | (PARTIAL if partial else {})
    result = _train(_config(tmp_path, assets, "stream1", **entries), "--launcher", "ray")
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    curve = _metrics(tmp_path / "stream1")
    assert [r["step"] for r in curve] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e3 for r in curve), curve  # finite
    if streaming:
        assert all(r["stream/staleness_max"] <= 1.0 for r in curve), curve
        positions = []
        for rank, records in enumerate(_stream_records(tmp_path / "stream1")):
            assert [r["batch"] for r in records] == [0, 1, 2, 3]
            for r in records:
                assert len(r["positions"]) == 1 and r["positions"][0] % 2 == rank, r  # this rank's own prompts
                assert all(r["batch"] - v <= 1 for v in r["start_versions"]), r
            positions += [p for r in records for p in r["positions"]]
        assert sorted(positions) == list(range(8)), "every prompt position trained exactly once"
    if partial:
        assert all(r["partial/token_staleness_max"] <= 1.0 for r in curve), curve
    (stats,) = _rollout_actor_stats(result.stdout + result.stderr)
    assert stats["received"] == [] and stats["loaded"] == sorted(set(stats["loaded"])) and stats["loaded"], stats


def test_reward_workers_under_ray_reproduce_the_in_process_rewards(tmp_path, assets, torchrun_run):
    """reward.ray_workers=2: both ranks' rewards are scored on 2 Ray reward actors (chunks of each batch); the
    rewards, hence losses and final weights, are the in-process (torchrun) run's."""
    config = _config(tmp_path, assets, "rewards", reward={"ray_workers": 2})
    result = _train(config, "--launcher", "ray")
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    curve = assert_same_run(torchrun_run, tmp_path / "rewards")
    assert all(row["reward/calls"] > 0 and row["reward/failures"] == 0 for row in curve), curve
    prefix = "ray: reward actor "
    output = result.stdout + result.stderr
    stats = [json.loads(line.split(prefix, 1)[1]) for line in output.splitlines() if prefix in line]
    assert sorted(s["index"] for s in stats) == [0, 1], output[-3000:]
    # 3 steps x (2 prompts x 2 samples) rewards (+ held-out evaluation), shared by the two actors; both ranks
    # registered on both
    assert all(s["scored"] > 0 and s["callers"] == 2 for s in stats), stats
    assert sum(s["scored"] for s in stats) >= 12 == sum(row["reward/calls"] for row in curve), stats


@pytest.mark.parametrize(
    ("entries", "launch", "fragment"),
    [
        ({}, (), "which only --launcher ray starts (this run's launcher: local)"),
        ({"rollout.engine": "vllm"}, ("--launcher", "ray"), "set rollout.vllm.mode=server"),
        ({"rollout.num_actors": 0}, ("--launcher", "ray"), "rollout.num_actors=0 must be >= 1"),
    ],
)
def test_unsupported_disaggregated_setups_are_refused_before_any_actor_starts(
    tmp_path, assets, entries, launch, fragment
):
    config = _config(tmp_path, assets, "refused", **{"rollout.placement": "disaggregated"}, **entries)
    result = _train(config, *launch)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and lines[-1].startswith("shardforge: error: "), result.stderr[-3000:]
    assert fragment in lines[-1] and "Traceback" not in result.stderr, lines[-1]
    assert "ray: " not in result.stderr and not (tmp_path / "refused" / "metrics.jsonl").exists()
