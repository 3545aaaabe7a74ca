"""The launching `shardforge train` process imports only what its checks need (issue 25, start-up).

With ``--nproc-per-node N > 1`` the command checks the config in the launching process, then relaunches
itself under torchrun's agent; every rank imports the engine, transformers and DCP again. The launching
process must not: DTensor, FSDP, DCP and transformers cost it seconds before any rank started (on 2 CPU
cores, 1.5-3.7 s of CPU). Each case runs in a fresh interpreter (this one has imported everything).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from shardforge.algorithms.testing import tiny_assets

HEAVY = (
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "shardforge.engine.train_engine",
)

# Replaces the relaunch with a probe: what the launching process has imported once its checks passed.
PROBE = """
import json, sys
import shardforge.algorithms.launch.torchrun as launch
seen = {}
def probe(spec, argv, debug=False):
    seen["heavy"] = sorted(m for m in HEAVY if m in sys.modules)
    return 0
launch.relaunch = probe
from shardforge.algorithms.cli.main import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, **seen}))
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("launcher_assets"))


def _config(path, assets, algorithm):
    entries = {"model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(path / "out")}
    entries |= {"layout": "d2", "steps": 1, "progress": False}
    if algorithm == "sft":
        entries["global_batch_size"] = 4
    else:
        entries |= {"prompts_per_step": 2, "group_size": 2, "reward_fn": "shardforge.algorithms.testing:digit_reward"}
    config = path / f"{algorithm}.yaml"
    config.write_text(yaml.safe_dump(entries))
    return str(config)


def _launcher_env():
    """This environment as a user's shell has it: not inside torchrun (no WORLD_SIZE/RANK)."""
    return {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


@pytest.mark.parametrize("algorithm", ["sft", "grpo"])
def test_launching_process_imports_no_engine_or_transformers(tmp_path, assets, algorithm):
    code = f"HEAVY = {HEAVY!r}\n{PROBE}"
    args = ["train", algorithm, "--config", _config(tmp_path, assets, algorithm), "--nproc-per-node", "2"]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_launcher_env())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0 and "heavy" in result, result  # the checks passed and it reached the relaunch
    assert result["heavy"] == [], f"the launching process imported {result['heavy']} before relaunching"


def test_a_bad_config_is_still_refused_before_launch(tmp_path, assets):
    # The checks the launcher keeps (here: a layout that needs 4 ranks) still refuse before any relaunch.
    config = _config(tmp_path, assets, "sft")
    code = f"HEAVY = {HEAVY!r}\n{PROBE}"
    args = ["train", "sft", "--config", config, "--nproc-per-node", "2", "layout=d4"]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_launcher_env())
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rc"] == 1 and "heavy" not in result, result
    assert "layout='d4' needs 4 ranks" in done.stderr, done.stderr
