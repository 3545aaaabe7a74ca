"""examples/slurm/{sft,grpo}.sbatch (issue 21).

CI has no Slurm: the scripts run under a fake ``srun`` (starts the command once per node, with
SLURM_NODEID set, as srun does) and a fake ``scontrol`` (the node list expands to 127.0.0.1), so the
two "nodes" really train together over c10d and the command the script builds is the one tested.
`test_sbatch_on_a_real_slurm` submits the script to a real Slurm (`nox -s slurm` starts a one-node
slurmctld + slurmd from Debian's slurm-wlm) and is skipped when no Slurm answers.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardforge.algorithms.testing import tiny_assets

REPO = Path(__file__).resolve().parents[1]
SHARDFORGE = f"{sys.executable} -m shardforge.algorithms.cli"
FAKE_SRUN = """#!/bin/bash
# fake srun: one task per node, SLURM_NODEID=0..SLURM_NNODES-1, like `srun --ntasks-per-node=1`
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!); done
code=0
for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
exit $code
"""
FAKE_SCONTROL = (
    '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && [ "$3" = "fake[1-2]" ] && printf "127.0.0.1\\nfake2\\n"\n'
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("slurm"), max_operand=9, num_eval=10)


def _free_port() -> int:
    from shardforge.mesh import free_port  # below the ephemeral range: parallel tests cannot take it meanwhile

    return free_port()


def _config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _fake_slurm_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755 | stat.S_IEXEC)
    return bin_dir


def _script_env(tmp_path: Path, config: Path, out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WORLD_SIZE", "RANK", "LOCAL_RANK"))}
    return env | {
        "PATH": f"{_fake_slurm_bin(tmp_path)}:{env['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "fake[1-2]",
        "CONFIG": str(config),
        "OUT": str(out),
        "NPROC_PER_NODE": "1",
        "RDZV_PORT": str(_free_port()),
        "SHARDFORGE": SHARDFORGE,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _train_steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if r.get("split") == "train"]


@pytest.mark.heavy  # heavy (~55 s): CI keeps the generated-command check (test_grpo_sbatch_builds_the_same_command_for_grpo)
def test_sft_sbatch_runs_two_nodes_through_its_srun_command(tmp_path, assets):
    out = tmp_path / "shared" / "sft"
    config = _config(tmp_path, {"model": str(assets["model"]), "train_file": str(assets["train"]),
                                "output_dir": "ignored", "global_batch_size": 4, "steps": 3, "progress": False,
                                "engine": {"max_tokens_per_microbatch": 64}})  # fmt: skip
    env = _script_env(tmp_path, config, out)
    result = subprocess.run(["bash", str(REPO / "examples/slurm/sft.sbatch"), "eval_every=0"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert _train_steps(out) == [1, 2, 3]  # output_dir came from OUT
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"].startswith("r1d2"), summary  # 2 nodes x 1 rank = one FSDP group of 2
    assert "rank 1 of 2" in (out / "logs" / "rank1.log").read_text()


def test_grpo_sbatch_builds_the_same_command_for_grpo(tmp_path):
    """The GRPO script differs from the SFT one only in trainer, config and output name."""
    sft = (REPO / "examples/slurm/sft.sbatch").read_text()
    grpo = (REPO / "examples/slurm/grpo.sbatch").read_text()
    assert "train grpo" in grpo and "examples/grpo_tiny.yaml" in grpo
    norm = grpo.replace("grpo", "sft").replace("GRPO", "SFT")
    assert norm == sft


def _real_slurm() -> bool:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0 and "idle" in result.stdout


@pytest.mark.skipif(not _real_slurm(), reason="no Slurm answers here (`nox -s slurm` starts a local one)")
def test_sbatch_on_a_real_slurm(tmp_path, assets):
    out = tmp_path / "real"
    config = _config(tmp_path, {"model": str(assets["model"]), "train_file": str(assets["train"]),
                                "output_dir": "ignored", "global_batch_size": 4, "steps": 2, "progress": False,
                                "engine": {"max_tokens_per_microbatch": 64}})  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"} | {
        "CONFIG": str(config), "OUT": str(out), "NPROC_PER_NODE": "2", "RDZV_PORT": str(_free_port()),
        "SHARDFORGE": SHARDFORGE, "HF_HUB_OFFLINE": "1",
    }  # fmt: skip
    log = tmp_path / "job.out"
    result = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", "--no-requeue", f"--output={log}", "--export=ALL",
         str(REPO / "examples/slurm/sft.sbatch")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, (result.stderr, log.read_text() if log.exists() else "")
    assert _train_steps(out) == [1, 2]
