"""Multi-node launch for `shardforge train`: torchrun's c10d rendezvous flags, and Slurm's environment.

`shardforge train` relaunches itself through torchrun's elastic agent (`launch.relaunch`). On one
machine that is ``torchrun --standalone``; across machines every node runs the same command with
``--nnodes N --node-rank I --rdzv-endpoint HOST:PORT`` (torchrun's own flag names), and the agents
meet at the c10d store on HOST:PORT (the node whose address is HOST hosts it). Under Slurm
(``--launcher slurm``, or inside a multi-node ``srun`` step) the node count, this node's rank, the
endpoint host (the step's first node, from ``scontrol show hostnames``) and the rendezvous id (the
job id) come from ``SLURM_*`` variables; flags given explicitly win. ``--launcher ray`` runs the
``--nnodes x --nproc-per-node`` ranks as Ray actors instead (`shardforge.algorithms.launch.ray`).
See docs/multinode.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
from collections.abc import Mapping

from shardforge.core.log import get_logger

__all__ = ["LaunchSpec", "add_launch_arguments", "launch_spec", "slurm_first_host", "strip_launch_args"]

log = get_logger(__name__)

DEFAULT_RDZV_PORT = 29400  # torchrun's default c10d port
_LAUNCHERS = ("auto", "local", "slurm", "ray")
# Flags that only the launching process reads; the ranks get argv without them.
_VALUE_FLAGS = (
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-backend",
    "--rdzv-conf",
    "--max-restarts",
    "--launcher",
    "--ray-address",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """How this node's torchrun agent joins the run."""

    nproc_per_node: int
    """Ranks started on this node."""
    nnodes: int = 1
    """Nodes in the run; every node starts ``nproc_per_node`` ranks."""
    node_rank: int = 0
    """This node's index in ``[0, nnodes)``; node 0 holds global rank 0."""
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of the c10d rendezvous store (hosted by the node whose address is HOST)."""
    rdzv_id: str = "shardforge"
    """Rendezvous id: the same on every node of one run, different for concurrent runs on one endpoint."""
    rdzv_backend: str = "c10d"
    """torchrun rendezvous backend (``c10d``; ``etcd``/``etcd-v2`` need an etcd server)."""
    rdzv_conf: str = ""
    """torchrun ``--rdzv-conf`` (e.g. ``join_timeout=900``: seconds to wait for every node)."""
    max_restarts: int = 0
    """Times the agents restart every rank after a failure (pair with ``resume=auto``)."""
    launcher: str = "local"
    """``ray``: the ranks run as Ray actors (`ray_launch`); otherwise through torchrun's agent."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and self.rdzv_endpoint is None

    @property
    def needs_agent(self) -> bool:
        """True when this process must start torchrun's agent (more than one rank, a rendezvous or restarts)."""
        return self.nproc_per_node > 1 or not self.standalone or self.max_restarts > 0

    def torchrun_args(self) -> list[str]:
        """torchrun flags (before ``-m module``) for this node."""
        common = [f"--nproc-per-node={self.nproc_per_node}", f"--max-restarts={self.max_restarts}"]
        if self.standalone:
            return ["--standalone", *common]
        args = [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--rdzv-backend={self.rdzv_backend}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            *common,
        ]
        return args + ([f"--rdzv-conf={self.rdzv_conf}"] if self.rdzv_conf else [])


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-node flags of `shardforge train` (torchrun's names; defaults None = not given)."""
    group = parser.add_argument_group("multi-node (torchrun c10d rendezvous; see docs/multinode.md)")
    group.add_argument("--nnodes", type=int, default=None, help="nodes in the run (default 1, or Slurm's)")
    group.add_argument("--node-rank", type=int, default=None, help="this node's index in [0, nnodes)")
    group.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (a host every node reaches)")
    group.add_argument("--rdzv-id", default=None, help="run id, the same on every node (default: Slurm job id)")
    group.add_argument("--rdzv-backend", default="c10d", help="torchrun rendezvous backend (default c10d)")
    group.add_argument("--rdzv-conf", default="", help="torchrun --rdzv-conf, e.g. join_timeout=900")
    group.add_argument("--max-restarts", type=int, default=0, help="restart every rank up to K times on a failure")
    group.add_argument(
        "--launcher",
        choices=_LAUNCHERS,
        default="auto",
        help="slurm: take nnodes/node-rank/endpoint from SLURM_* (auto: inside a multi-node srun step); "
        "ray: run the nnodes x nproc-per-node ranks as Ray actors",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="with --launcher ray: the cluster to join (e.g. auto, or HOST:6379); default: RAY_ADDRESS or a local one",
    )


def strip_launch_args(argv: list[str]) -> list[str]:
    """``argv`` without the launch flags (``--flag V`` or ``--flag=V``): the ranks never read them."""
    cleaned: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _VALUE_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in _VALUE_FLAGS)):
            cleaned.append(arg)
    return cleaned


def slurm_first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``node[01-04]``), expanded by ``scontrol show hostnames``."""
    try:
        result = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(
            f"cannot expand SLURM node list {nodelist!r} with `scontrol show hostnames` ({exc}); "
            "pass --rdzv-endpoint HOST:PORT explicitly"
        ) from exc
    hosts = result.stdout.split()
    if not hosts:
        raise ValueError(f"`scontrol show hostnames {nodelist}` printed no host; pass --rdzv-endpoint HOST:PORT")
    return hosts[0]


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    return "SLURM_STEP_ID" in env and int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))) > 1


def _slurm_defaults(env: Mapping[str, str]) -> tuple[int, int, str | None, str]:
    """(nnodes, node rank, first host or None, rendezvous id) of this Slurm step."""
    missing = [name for name in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID") if name not in env]
    if missing:
        raise ValueError(f"--launcher slurm needs {', '.join(missing)} in the environment; run it under srun")
    nnodes = int(env.get("SLURM_STEP_NUM_NODES", env["SLURM_NNODES"]))
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", str(nnodes))))
    if tasks != nnodes:
        raise ValueError(
            f"--launcher slurm runs one `shardforge` task per node (it starts the node's ranks itself), but the "
            f"step has {tasks} tasks on {nnodes} nodes; use `srun --ntasks-per-node=1` and --nproc-per-node"
        )
    nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
    host = slurm_first_host(nodelist) if nodelist else None
    return nnodes, int(env["SLURM_NODEID"]), host, f"slurm-{env['SLURM_JOB_ID']}"


def _check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--rdzv-endpoint={endpoint!r} must be HOST:PORT with a port in 1..65535, "
            f"e.g. {(host or endpoint) or 'node01'}:{DEFAULT_RDZV_PORT}"
        )


def launch_spec(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> LaunchSpec:
    """The validated launch of this node from the parsed flags (and ``SLURM_*`` for the Slurm launcher)."""
    env = os.environ if env is None else env
    nnodes, node_rank, endpoint, rdzv_id = args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id
    launcher = args.launcher
    if launcher == "auto" and _in_slurm_step(env) and nnodes is None:
        launcher = "slurm"
        log.info("inside a %s-node srun step: taking the node count, node rank and endpoint from SLURM_*",
                 env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES")))  # fmt: skip
    if getattr(args, "ray_address", None) is not None and launcher != "ray":
        raise ValueError(f"--ray-address needs --launcher ray (got --launcher {launcher})")
    if launcher == "ray":
        given = [flag for flag, value in (("--node-rank", node_rank), ("--rdzv-endpoint", endpoint),
                                          ("--rdzv-id", rdzv_id)) if value is not None]  # fmt: skip
        if given or args.max_restarts:
            raise ValueError(
                f"--launcher ray places every rank itself and restarts nothing: drop {given or ['--max-restarts']} "
                "(Ray runs nnodes x nproc-per-node ranks in one placement group; docs/multinode.md, 'Ray')"
            )
    if launcher == "slurm":
        slurm_nnodes, slurm_node_rank, slurm_host, slurm_id = _slurm_defaults(env)
        nnodes = slurm_nnodes if nnodes is None else nnodes
        node_rank = slurm_node_rank if node_rank is None else node_rank
        rdzv_id = slurm_id if rdzv_id is None else rdzv_id
        if endpoint is None and slurm_host is not None:
            endpoint = f"{slurm_host}:{DEFAULT_RDZV_PORT}"
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={args.nproc_per_node} must be >= 1")
    if nnodes < 1:
        raise ValueError(f"--nnodes={nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank={node_rank} is out of range for --nnodes={nnodes}; valid: 0..{nnodes - 1}")
    if nnodes > 1 and endpoint is None and launcher != "ray":
        raise ValueError(
            f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (a host:port every node reaches, the same on "
            f"every node, e.g. the first node's address:{DEFAULT_RDZV_PORT})"
        )
    if endpoint is not None:
        _check_endpoint(endpoint)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0")
    return LaunchSpec(
        nproc_per_node=args.nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=endpoint,
        rdzv_id=str(rdzv_id or "shardforge"),
        rdzv_backend=args.rdzv_backend,
        rdzv_conf=args.rdzv_conf,
        max_restarts=args.max_restarts,
        launcher="ray" if launcher == "ray" else "local",
    )
