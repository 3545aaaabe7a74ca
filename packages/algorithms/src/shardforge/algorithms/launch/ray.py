"""`shardforge train ... --launcher ray`: the trainer's ranks as Ray actors in one placement group.

Each rank is an actor (`_RankActor`) pinned to one bundle of a placement group (``{"CPU": 1}``, plus
``{"GPU": 1}`` when the cluster has a GPU per rank). Rank 0's actor picks ``MASTER_ADDR`` (its node's
IP) and a free ``MASTER_PORT``; every actor then sets the torchrun variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and runs the
same `shardforge` command in-process as one rank, so the ranks meet in c10d's TCP store rendezvous
exactly as under torchrun, and the run (seeds, data order, losses) is the same.

Errors: each actor returns its exit code and its one-line error (`launch.write_rank_error`, into a
directory of its own: Ray nodes share no filesystem). When the first rank fails the others are
killed (they would only wait for the collective timeout) and the earliest error line is printed,
as under torchrun. Ctrl-C kills every actor.

``rollout.placement: disaggregated`` (`shardforge.rollout.ray.placement`): ``rollout.num_actors`` more
bundles in the same group hold `RolloutActor`s (the embedded HF engine each), or, with ``rollout.engine: vllm``,
one `VLLMServerActor` (``vllm serve`` in its bundle, with ``rollout.vllm.tensor_parallel_size`` GPUs when the cluster
has GPUs; `rollout.ray_vllm_server`); every rank learns their names from ``SHARDFORGE_RAY_ROLLOUT_ACTORS`` and
generates through them. At the end the driver logs what each served (the weight versions it received, its
generate calls or restarts) and stops a vLLM server before it kills its actor. ``reward.ray_workers: N``
(`shardforge.rewards.ray_pool`): N more one-CPU bundles hold `RewardActor`s that score the ranks'
rewards (names in ``SHARDFORGE_RAY_REWARD_ACTORS``). Not supported under Ray: ``--max-restarts`` (use the
torchrun launcher) and graceful stop at a step boundary (SIGTERM reaches only this driver).
See docs/multinode.md, "Ray".
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardforge.algorithms.launch.multinode import LaunchSpec, strip_launch_args
from shardforge.core.log import get_logger
from shardforge.rewards.ray_pool import REWARD_ACTORS_ENV, reward_actor_names
from shardforge.rollout.ray.placement import ROLLOUT_ACTORS_ENV, RolloutActorSpec, actor_names

__all__ = ["launch_ray"]

log = get_logger(__name__)

# The rollout actor class of each ``rollout.engine`` (imported when the launcher starts one).
_ROLLOUT_ACTORS = {
    "hf": "shardforge.rollout.ray.hf_actor:RolloutActor",
    "vllm": "shardforge.rollout.ray.vllm_server:VLLMServerActor",
}
# Variables a rank must not inherit from the driver's environment (they are set per rank).
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _RankActor:
    """One rank: answers where it runs, then runs `shardforge.algorithms.cli.main.main` with its rank variables."""

    def where(self) -> tuple[str, int]:
        """(node IP, a free port on that node)."""
        import socket

        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        return str(ray.util.get_node_ip_address()), port

    def run(self, entry: str, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
        """Run ``entry(argv)`` (``module:function``, the CLI's ``main``) as one rank; return
        ``{"rank", "code", "line", "time"}``."""
        from shardforge.algorithms.launch import torchrun as launch

        module, _, name = entry.partition(":")
        main: Callable[[list[str]], int] = getattr(importlib.import_module(module), name)
        os.environ.update(env)
        with tempfile.TemporaryDirectory(prefix="shardforge-rank-error-") as error_dir:
            os.environ[launch.ERROR_DIR_ENV] = error_dir  # this rank's one-line error lands here
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse errors, or a trainer's sys.exit
                code = exc.code if isinstance(exc.code, int) else 1
            record = _error_record(Path(error_dir))
        return {"rank": int(env["RANK"]), "code": code, "line": record.get("line"), "time": record.get("time")}


def _error_record(directory: Path) -> dict[str, Any]:
    for path in directory.glob("rank-*.json"):
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return {}


def _bundles(world: int, rollout: RolloutActorSpec | None, reward_workers: int, gpus: float) -> list[dict[str, float]]:
    """The placement group's bundles, in order: one per rank (a CPU, and a GPU when the cluster has ``gpus`` for
    every rank and rollout actor), one per rollout actor (the same, with `gpus_per_actor` GPUs: a vLLM server's
    tensor-parallel size), one CPU per reward actor."""
    num_rollout = rollout.num_actors if rollout is not None else 0
    per_actor = rollout.gpus_per_actor if rollout is not None else 1
    with_gpu = gpus >= world + num_rollout * per_actor
    rank = {"CPU": 1.0, "GPU": 1.0} if with_gpu else {"CPU": 1.0}
    actor = {"CPU": 1.0, "GPU": float(per_actor)} if with_gpu else {"CPU": 1.0}
    return (
        [dict(rank) for _ in range(world)]
        + [dict(actor) for _ in range(num_rollout)]
        + [{"CPU": 1.0} for _ in range(reward_workers)]
    )


def launch_ray(
    spec: LaunchSpec,
    argv: list[str],
    *,
    entry: str,
    address: str | None,
    debug: bool = False,
    rollout: RolloutActorSpec | None = None,
    reward_workers: int = 0,
) -> int:
    """Run ``entry(argv)`` on ``spec.world_size`` Ray actors, one rank each; return the exit code.

    ``entry`` is ``"module:function"`` (the CLI passes its ``main``; this module does not import the CLI,
    and a function of ``__main__`` would not reach the actors by name). ``rollout``: the rollout actors to start
    next to the ranks (``rollout.placement=disaggregated``; None: rollouts stay in the ranks). ``reward_workers``:
    the `RewardActor`s to start (``reward.ray_workers``; 0: rewards in the ranks)."""
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError as exc:
        raise ValueError(
            f"--launcher ray needs Ray ({exc}); install it with `pip install 'shardforge-algorithms[ray]'`"
        ) from exc
    world = spec.world_size
    num_rollout = rollout.num_actors if rollout is not None else 0
    extra: dict[str, Any] = {}
    if address is None and not os.environ.get("RAY_ADDRESS"):
        # A new local cluster: enough logical CPUs for every bundle (ranks and rollout actors share this
        # machine's cores anyway, as colocated rollouts do); Ray would otherwise count the cores only.
        extra["num_cpus"] = max(os.cpu_count() or 1, world + num_rollout + reward_workers)
        # and no dashboard web server: one process less on the ranks' cores for a cluster nobody browses
        extra["include_dashboard"] = False
    ray.init(address=address, log_to_driver=True, configure_logging=False, **extra)
    bundles = _bundles(world, rollout, reward_workers, float(ray.cluster_resources().get("GPU", 0.0)))
    bundle = bundles[0]
    group = placement_group(bundles, strategy="PACK", name="shardforge-ranks")
    ready, _ = ray.wait([group.ready()], timeout=120)
    if not ready:
        available = ray.cluster_resources()
        remove_placement_group(group)
        raise ValueError(
            f"the Ray cluster cannot place {world} ranks (+ {num_rollout} rollout actors) of {bundle} each "
            f"(+ {reward_workers} reward actors of 1 CPU) (it has CPU={available.get('CPU', 0):g}, "
            f"GPU={available.get('GPU', 0):g}); lower --nproc-per-node/--nnodes or add nodes"
        )
    actor_cls = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0))(_RankActor)
    actors = [
        actor_cls.options(  # type: ignore[attr-defined]
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            ),
            name=f"shardforge-rank-{index}",
        ).remote()
        for index in range(world)
    ]
    rollout_actors = _start_rollout_actors(ray, rollout, group, world, bundles[world]) if rollout is not None else []
    reward_actors = _start_reward_actors(ray, reward_workers, group, world + num_rollout)
    env = {ROLLOUT_ACTORS_ENV: ",".join(actor_names(num_rollout))} if rollout_actors else {}
    if reward_actors:
        env[REWARD_ACTORS_ENV] = ",".join(reward_actor_names(reward_workers))
    try:
        return _run_ranks(ray, actors, entry, strip_launch_args(argv), bundle, debug, env)
    except KeyboardInterrupt:
        log.warning("interrupted: killing every rank")
        return 130
    finally:
        _log_actor_stats(ray, rollout_actors, "rollout")
        _log_actor_stats(ray, reward_actors, "reward")
        if rollout is not None and rollout.engine == "vllm":  # its `vllm serve` would outlive a killed actor
            _call_each(ray, rollout_actors, "shutdown", timeout=60)
        for actor in actors + rollout_actors + reward_actors:
            ray.kill(actor)
        remove_placement_group(group)
        ray.shutdown()


def _start_rollout_actors(
    ray: Any, spec: RolloutActorSpec, group: Any, first_bundle: int, bundle: dict[str, float]
) -> list[Any]:
    """``spec.num_actors`` rollout actors (`RolloutActor`, or `VLLMServerActor` for ``rollout.engine: vllm``) on the
    group's bundles from ``first_bundle`` on (they load the model or start the server while the ranks start; the
    ranks' clients wait for them)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    module, _, class_name = _ROLLOUT_ACTORS[spec.engine].partition(":")
    actor_class = getattr(importlib.import_module(module), class_name)
    concurrency = int(getattr(actor_class, "max_concurrency", 1))
    actor_cls = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), max_concurrency=concurrency)(
        actor_class
    )
    strategies = [
        PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=first_bundle + index)
        for index in range(spec.num_actors)
    ]
    return [
        actor_cls.options(scheduling_strategy=strategy, name=name).remote(spec, index)  # type: ignore[attr-defined]
        for index, (name, strategy) in enumerate(zip(actor_names(spec.num_actors), strategies))
    ]


def _start_reward_actors(ray: Any, count: int, group: Any, first_bundle: int) -> list[Any]:
    """``count`` `RewardActor`s (``reward.ray_workers``) on the group's bundles from ``first_bundle`` on."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from shardforge.rewards.ray_pool import RewardActor

    actor_cls = ray.remote(num_cpus=1.0)(RewardActor)
    return [
        actor_cls.options(  # type: ignore[attr-defined]
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=first_bundle + index
            ),
            name=name,
        ).remote(index)
        for index, name in enumerate(reward_actor_names(count))
    ]


def _call_each(ray: Any, actors: list[Any], method: str, timeout: float) -> None:
    """Call ``method`` on every actor and wait up to ``timeout`` s (an actor that is gone is skipped)."""
    refs = [getattr(actor, method).remote() for actor in actors]
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout)
        except Exception as exc:
            log.warning("ray: %s on a rollout actor failed: %s", method, str(exc).splitlines()[0] if str(exc) else exc)


def _log_actor_stats(ray: Any, actors: list[Any], kind: str) -> None:
    """Log what every rollout/reward actor did (nothing when one is gone: the run's own error says why)."""
    for actor in actors:
        try:
            stats = ray.get(actor.stats.remote(), timeout=30)
        except Exception:
            continue
        log.info("ray: %s actor %s", kind, json.dumps(stats, sort_keys=True))


def _rank_env(index: int, ips: list[str], master: tuple[str, int], gpu: bool) -> dict[str, str]:
    """torchrun's variables for rank ``index``; local rank/world from the ranks that share its node."""
    same_node = [i for i, ip in enumerate(ips) if ip == ips[index]]
    env = {
        "RANK": str(index),
        "WORLD_SIZE": str(len(ips)),
        "LOCAL_RANK": str(same_node.index(index)),
        "LOCAL_WORLD_SIZE": str(len(same_node)),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    # the driver's shardforge settings (and test hooks) reach every rank, wherever Ray placed it
    env |= {key: value for key, value in os.environ.items() if key.startswith("SHARDFORGE_")}
    if gpu:  # Ray shows each actor only its own GPU (CUDA_VISIBLE_DEVICES): it is device 0 there
        env["LOCAL_RANK"] = "0"
    return env


def _run_ranks(
    ray: Any,
    actors: list[Any],
    entry: str,
    argv: list[str],
    bundle: dict[str, float],
    debug: bool,
    env: dict[str, str],
) -> int:
    places = ray.get([actor.where.remote() for actor in actors])
    ips = [ip for ip, _ in places]
    master = places[0]
    log.info("ray: %d ranks on %d node(s); rendezvous at %s:%d", len(actors), len(set(ips)), *master)
    pending = {
        actor.run.remote(entry, argv, _rank_env(index, ips, master, "GPU" in bundle) | env): index
        for index, actor in enumerate(actors)
    }
    results: list[dict[str, Any]] = []
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        ref = done[0]
        index = pending.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # the actor's process died (OOM, SIGKILL, a crash)
            result = {"rank": index, "code": 1, "line": None, "time": time.time(), "died": str(exc)}
        results.append(result)
        if result["code"] != 0:  # the others would wait for the collective timeout: stop them now
            for other in pending.values():
                ray.kill(actors[other])
            # let the killed ranks' refs settle, so their errors are not reported as the cause
            ray.wait(list(pending), num_returns=len(pending), timeout=10)
            break
    failed = [r for r in results if r["code"] != 0]
    if not failed:
        return 0
    with_line = [r for r in failed if r.get("line")]
    if with_line:
        first = min(with_line, key=lambda r: (r["time"], r["rank"]))
        sys.stderr.write(str(first["line"]))
    else:
        first = failed[0]
        detail = f": {first['died']}" if debug and "died" in first else ""
        sys.stderr.write(
            f"shardforge: rank {first['rank']} (a Ray actor) exited with code {first['code']}{detail}; rerun with "
            "--debug for every rank's traceback\n"
        )
    return int(first["code"]) if int(first["code"]) > 0 else 1
