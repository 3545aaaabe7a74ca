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
import yaml

pytest.importorskip("ray")

from shardforge.algorithms.testing import tiny_assets

ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
for _var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
    ENV.pop(_var, None)
ENV["RAY_USAGE_STATS_ENABLED"] = "0"
CLI = [sys.executable, "-m", "shardforge.algorithms.cli"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("ray"), max_operand=9, num_eval=10)


def _config(tmp_path: Path, assets, name: str, **entries) -> Path:
    data = {
        "model": str(assets["model"]),
        "train_file": str(assets["train"]),
        "output_dir": str(tmp_path / name),
        "steps": 3,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_new_tokens": 3,
        "progress": False,
        "engine": {"max_tokens_per_microbatch": 64},
    } | entries
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _train(config: Path, *launch: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "train", "grpo", "--config", str(config), "--nproc-per-node", "2", *launch],
                          env=ENV, capture_output=True, text=True, timeout=900)  # fmt: skip


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if r.get("split") == "train"]


def test_grpo_under_ray_reproduces_the_torchrun_run(tmp_path, assets):
    torchrun = _train(_config(tmp_path, assets, "torchrun"))
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    ray_run = _train(_config(tmp_path, assets, "ray"), "--launcher", "ray")
    assert ray_run.returncode == 0, (ray_run.stdout[-3000:], ray_run.stderr[-3000:])
    reference, curve = _losses(tmp_path / "torchrun"), _losses(tmp_path / "ray")
    assert [s for s, _ in curve] == [s for s, _ in reference] == [1, 2, 3]
    for (step, expected), (_, got) in zip(reference, curve):
        assert abs(got - expected) <= 1e-6 * abs(expected), (step, got, expected)
    # both ranks ran under Ray and logged their own line; the summary records the same layout
    assert "rank 1 of 2" in (tmp_path / "ray" / "logs" / "rank1.log").read_text()
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("torchrun", "ray")]
    assert summaries[0]["layout"] == summaries[1]["layout"]


def test_a_stuck_rank_under_ray_ends_the_run_with_the_one_line_timeout_error(tmp_path, assets):
    """Rank 1 sleeps 400 s in step 2 (SHARDFORGE_FAULT_SLEEP, forwarded to the actors): rank 0's collective
    times out after 4 s, its one-line error (naming rank 1's frame) is the command's, rank 1 is killed."""
    config = _config(tmp_path, assets, "stuck", engine={"max_tokens_per_microbatch": 64, "dist_timeout_s": 4})
    env = ENV | {"SHARDFORGE_FAULT_SLEEP": "1:2:400"}
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
