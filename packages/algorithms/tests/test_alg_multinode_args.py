"""`shardforge train` multi-node flags -> torchrun flags, Slurm's environment -> the same, and the
one-line errors for bad input (issue 21). No process group is started here."""

from __future__ import annotations

import argparse
import stat

import pytest

from shardforge.algorithms.cli.main import _parser, main
from shardforge.algorithms.launch.multinode import LaunchSpec, launch_spec, strip_launch_args


@pytest.fixture(autouse=True)
def _outside_torchrun_and_slurm(monkeypatch):
    import os

    for var in [v for v in os.environ if v.startswith("SLURM_")] + ["WORLD_SIZE", "RANK", "LOCAL_RANK"]:
        monkeypatch.delenv(var, raising=False)


def _args(*flags: str) -> argparse.Namespace:
    args, _ = _parser().parse_known_args(["train", "sft", "--config", "c.yaml", *flags])
    return args


def _spec(*flags: str, env: dict[str, str] | None = None) -> LaunchSpec:
    return launch_spec(_args(*flags), env or {})


def test_one_node_is_standalone_and_needs_no_agent_for_one_rank():
    spec = _spec()
    assert spec.standalone and not spec.needs_agent and spec.world_size == 1
    spec = _spec("--nproc-per-node", "4")
    assert spec.needs_agent and spec.torchrun_args() == ["--standalone", "--nproc-per-node=4", "--max-restarts=0"]
    assert _spec("--max-restarts", "2").needs_agent  # restarts need the agent even for one rank


def test_two_nodes_pass_torchruns_c10d_flags():
    spec = _spec(*"--nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-endpoint node01:29400 --rdzv-id job7 "
                 "--max-restarts 3 --rdzv-conf join_timeout=900".split())  # fmt: skip
    assert spec.world_size == 16 and not spec.standalone
    assert spec.torchrun_args() == [
        "--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=node01:29400", "--rdzv-id=job7",
        "--nproc-per-node=8", "--max-restarts=3", "--rdzv-conf=join_timeout=900",
    ]  # fmt: skip
    # an endpoint on one node is a rendezvous too (e.g. to restart with a fixed port), not --standalone
    assert "--standalone" not in _spec("--rdzv-endpoint", "h:1").torchrun_args()


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        ("--nnodes 2 --node-rank 2 --rdzv-endpoint h:29400", ["--node-rank=2 is out of range", "valid: 0..1"]),
        ("--nnodes 2 --node-rank -1 --rdzv-endpoint h:29400", ["--node-rank=-1 is out of range"]),
        ("--nnodes 2 --node-rank 0", ["--nnodes=2 needs --rdzv-endpoint HOST:PORT"]),
        ("--nnodes 2 --rdzv-endpoint node01", ["--rdzv-endpoint='node01' must be HOST:PORT", "node01:29400"]),
        ("--nnodes 2 --rdzv-endpoint node01:http", ["must be HOST:PORT with a port in 1..65535"]),
        ("--nnodes 2 --rdzv-endpoint :29400", ["must be HOST:PORT"]),
        ("--nnodes 0", ["--nnodes=0 must be >= 1"]),
        ("--max-restarts -1", ["--max-restarts=-1 must be >= 0"]),
        ("--nproc-per-node 0", ["--nproc-per-node=0 must be >= 1"]),
    ],
)
def test_bad_launch_flags_are_one_line_errors_before_anything_starts(tmp_path, capsys, flags, fragments):
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tmp_path}/missing\ntrain_file: x.jsonl\noutput_dir: {tmp_path}/run\n")
    code = main(["train", "sft", "--config", str(config), *flags.split()])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("shardforge: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_ranks_get_argv_without_launch_flags():
    argv = ["train", "sft", "--config", "c.yaml", "--nproc-per-node", "2", "--nnodes=2", "--node-rank", "1",
            "--rdzv-endpoint", "h:1", "--rdzv-id=x", "--max-restarts", "1", "--launcher", "slurm", "steps=3"]  # fmt: skip
    assert strip_launch_args(argv) == ["train", "sft", "--config", "c.yaml", "steps=3"]


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """An `scontrol` on PATH that expands ``gpu[07-08]`` the way Slurm does."""
    path = tmp_path / "bin" / "scontrol"
    path.parent.mkdir()
    path.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 2\n'
                    'case "$3" in "gpu[07-08]") printf "gpu07\\ngpu08\\n";; *) echo "$3";; esac\n')  # fmt: skip
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{path.parent}:{__import__('os').environ['PATH']}")
    return path


def _slurm_env(node_id: int, **extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": str(node_id), "SLURM_NTASKS": "2",
           "SLURM_JOB_NODELIST": "gpu[07-08]"}  # fmt: skip
    return env | extra


def test_slurm_launcher_takes_nodes_rank_endpoint_and_id_from_slurm(fake_scontrol):
    specs = [_spec("--launcher", "slurm", "--nproc-per-node", "4", env=_slurm_env(i)) for i in (0, 1)]
    assert [s.node_rank for s in specs] == [0, 1]
    for spec in specs:
        assert (spec.nnodes, spec.world_size, spec.rdzv_endpoint, spec.rdzv_id) == (2, 8, "gpu07:29400", "slurm-4242")
    # explicit flags win over Slurm's values
    spec = _spec("--launcher", "slurm", "--rdzv-endpoint", "10.0.0.1:6000", "--rdzv-id", "mine", env=_slurm_env(1))
    assert (spec.rdzv_endpoint, spec.rdzv_id, spec.node_rank) == ("10.0.0.1:6000", "mine", 1)


def test_auto_detects_a_multi_node_srun_step_but_not_a_one_node_job(fake_scontrol):
    step = _slurm_env(1, SLURM_STEP_ID="0", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2",
                      SLURM_STEP_NODELIST="gpu[07-08]")  # fmt: skip
    spec = _spec(env=step)
    assert (spec.nnodes, spec.node_rank, spec.rdzv_endpoint) == (2, 1, "gpu07:29400")
    one_node = _slurm_env(0, SLURM_STEP_ID="0", SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1")
    assert _spec(env=one_node).standalone
    assert _spec("--launcher", "local", env=step).standalone  # local: ignore Slurm


def test_slurm_launcher_errors_name_the_fix(fake_scontrol, monkeypatch):
    with pytest.raises(ValueError, match="--ntasks-per-node=1"):
        _spec("--launcher", "slurm", env=_slurm_env(0, SLURM_NTASKS="8"))
    with pytest.raises(ValueError, match=r"needs SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID.*run it under srun"):
        _spec("--launcher", "slurm", env={})
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="pass --rdzv-endpoint HOST:PORT explicitly"):
        _spec("--launcher", "slurm", env=_slurm_env(0))


def test_ray_launcher_places_nnodes_times_nproc_ranks_and_refuses_torchrun_only_flags():
    spec = _spec("--launcher", "ray", "--nproc-per-node", "2", "--nnodes", "3")
    assert spec.launcher == "ray" and spec.world_size == 6  # no --rdzv-endpoint needed: Ray places the ranks
    assert _spec("--nproc-per-node", "2").launcher == "local"
    for flags in (["--node-rank", "1"], ["--rdzv-endpoint", "h:1"], ["--rdzv-id", "x"], ["--max-restarts", "1"]):
        with pytest.raises(ValueError, match="--launcher ray places every rank itself"):
            _spec("--launcher", "ray", "--nnodes", "2", *flags)
    with pytest.raises(ValueError, match="--ray-address needs --launcher ray"):
        _spec("--ray-address", "auto")
    argv = ["train", "grpo", "--config", "c.yaml", "--launcher", "ray", "--ray-address=auto", "--nproc-per-node", "2"]
    assert strip_launch_args(argv) == ["train", "grpo", "--config", "c.yaml"]  # the ranks never see them


def test_ray_rank_environment_is_torchruns():
    from shardforge.algorithms.launch.ray import _rank_env

    ips = ["10.0.0.1", "10.0.0.1", "10.0.0.2"]
    env = _rank_env(2, ips, ("10.0.0.1", 1234), gpu=False)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
    }  # fmt: skip
    assert _rank_env(1, ips, ("10.0.0.1", 1234), gpu=False)["LOCAL_RANK"] == "1"
    assert _rank_env(1, ips, ("10.0.0.1", 1234), gpu=True)["LOCAL_RANK"] == "0"  # Ray shows it one GPU
