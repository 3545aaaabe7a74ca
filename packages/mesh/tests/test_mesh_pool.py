"""Real multi-rank tests on local gloo ranks via the shared `get_rank_pool` pools.

Functions sent to the ranks are module-level so they can be pickled. Expected groups are
written out by hand from the row-major layout ``[pp, dp_replicate, dp_shard, cp, tp]``.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh import ParallelDims, build_mesh, init_distributed
from shardforge.mesh.testing import RankFailure, get_rank_pool, run_on_ranks

ALL_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "fsdp", "dp_cp", "ep", "efsdp")


# ---------------------------------------------------------------------------------------------- rank functions
def _probe_mesh(spec: str) -> dict:
    """Build the mesh and, for every present axis, measure its group with real collectives."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = build_mesh(ParallelDims.parse(spec), device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank, "present": sorted(a for a in ALL_AXES if mesh.has(a)), "axes": {}}
    for axis in ALL_AXES:  # same order on every rank: each axis's groups partition the world
        if not mesh.has(axis):
            continue
        group = mesh.get(axis).get_group()
        rank_sum = torch.tensor([float(rank)])
        dist.all_reduce(rank_sum, group=group)
        one_hot = torch.zeros(world)
        one_hot[rank] = 1.0
        dist.all_reduce(one_hot, group=group)
        gathered = [torch.zeros(1) for _ in range(mesh.size(axis))]
        dist.all_gather(gathered, torch.tensor([float(rank)]), group=group)
        out["axes"][axis] = {
            "sum": rank_sum.item(),
            "members": [r for r in range(world) if one_hot[r].item() == 1.0],
            "order": [int(t.item()) for t in gathered],
            "local_rank": mesh.local_rank(axis),
            "size": mesh.size(axis),
        }
    # The groups are left alone: DeviceMesh may share process groups between meshes built
    # in the same worker, so destroying them here could break later tests on this pool.
    return out


def _build_error(spec: str) -> str:
    try:
        build_mesh(ParallelDims.parse(spec), device_type="cpu")
    except ValueError as exc:  # caught here so the shared pool is not restarted
        return str(exc)
    return "no error"


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _init_is_noop() -> tuple[tuple[int, int], bool, str]:
    before = dist.group.WORLD
    got = init_distributed(backend="definitely-not-a-backend")
    return got, dist.group.WORLD is before, dist.get_backend()


def _fail_on_rank_one(tag: str) -> int:
    if dist.get_rank() == 1:
        raise ValueError(f"boom from rank 1 ({tag})")
    return dist.get_rank()


def _slow_low_ranks(x: int, *, y: str) -> tuple[int, int, str, int]:
    rank = dist.get_rank()
    time.sleep(0.1 * (dist.get_world_size() - rank))  # the highest rank answers first
    return rank, x, y, os.getpid()


# ---------------------------------------------------------------------------------------------- expected layouts
# spec -> {axis: groups}; axes not listed must be absent (size 1).
WORLD2 = {
    "d2": {a: [[0, 1]] for a in ("dp_shard", "dp", "fsdp", "dp_cp", "efsdp")},
    "t2": {"tp": [[0, 1]]},
    "c2": {a: [[0, 1]] for a in ("cp", "fsdp", "dp_cp", "efsdp")},
    "p2": {"pp": [[0, 1]]},
    "r2": {a: [[0, 1]] for a in ("dp_replicate", "dp", "dp_cp")},
    "d2e2": {a: [[0, 1]] for a in ("dp_shard", "dp", "fsdp", "dp_cp", "ep")},
    "t2e2": {a: [[0, 1]] for a in ("tp", "ep")},
}
_ALL4 = [[0, 1, 2, 3]]
_PAIRS = [[0, 1], [2, 3]]  # inner axis
_STRIDED = [[0, 2], [1, 3]]  # outer axis
WORLD4 = {
    "d4": {a: _ALL4 for a in ("dp_shard", "dp", "fsdp", "dp_cp", "efsdp")},
    "r2d2": {
        "dp_replicate": _STRIDED,
        "dp_shard": _PAIRS,
        "dp": _ALL4,
        "fsdp": _PAIRS,
        "dp_cp": _ALL4,
        "efsdp": _PAIRS,
    },
    "d2t2": {
        "dp_shard": _STRIDED,
        "tp": _PAIRS,
        "dp": _STRIDED,
        "fsdp": _STRIDED,
        "dp_cp": _STRIDED,
        "efsdp": _STRIDED,
    },
    "d2c2": {"dp_shard": _STRIDED, "cp": _PAIRS, "dp": _STRIDED, "fsdp": _ALL4, "dp_cp": _ALL4, "efsdp": _ALL4},
    "c2t2": {"cp": _STRIDED, "tp": _PAIRS, "fsdp": _STRIDED, "dp_cp": _STRIDED, "efsdp": _STRIDED},
    "p2d2": {"pp": _STRIDED, "dp_shard": _PAIRS, "dp": _PAIRS, "fsdp": _PAIRS, "dp_cp": _PAIRS, "efsdp": _PAIRS},
    "r2t2": {"dp_replicate": _STRIDED, "tp": _PAIRS, "dp": _STRIDED, "dp_cp": _STRIDED},
    "d4e2": {"dp_shard": _ALL4, "dp": _ALL4, "fsdp": _ALL4, "dp_cp": _ALL4, "ep": _PAIRS, "efsdp": _STRIDED},
    "d2c2e2": {
        **{"dp_shard": _STRIDED, "cp": _PAIRS, "dp": _STRIDED, "fsdp": _ALL4, "dp_cp": _ALL4},
        **{"ep": _PAIRS, "efsdp": _STRIDED},
    },
    # etp == 1: experts borrow dp_shard x tp, so ep takes the inner (tp) ranks
    "d2t2e2": {
        **{"dp_shard": _STRIDED, "tp": _PAIRS, "dp": _STRIDED, "fsdp": _STRIDED, "dp_cp": _STRIDED},
        **{"ep": _PAIRS, "efsdp": _STRIDED},
    },
    # etp == tp: experts borrow dp_shard only, so ep runs along dp_shard and efsdp has size 1
    "d2t2e2x2": {
        "dp_shard": _STRIDED,
        "tp": _PAIRS,
        "dp": _STRIDED,
        "fsdp": _STRIDED,
        "dp_cp": _STRIDED,
        "ep": _STRIDED,
    },
    "d2c2e4": {"dp_shard": _STRIDED, "cp": _PAIRS, "dp": _STRIDED, "fsdp": _ALL4, "dp_cp": _ALL4, "ep": _ALL4},
}


def _check_probe(results: list[dict], expected: dict[str, list[list[int]]]) -> None:
    for rank, got in enumerate(results):
        assert got["rank"] == rank
        assert got["present"] == sorted(expected)
        for axis, groups in expected.items():
            (group,) = [g for g in groups if rank in g]
            measured = got["axes"][axis]
            where = f"rank={rank} axis={axis}"
            assert measured["members"] == sorted(group), where
            assert measured["sum"] == sum(group), where
            assert measured["order"] == group, where
            assert measured["local_rank"] == group.index(rank), where
            assert measured["size"] == len(group), where


@pytest.mark.parametrize("spec", sorted(WORLD2))
def test_build_mesh_world2(spec):
    _check_probe(get_rank_pool(2).run(_probe_mesh, spec), WORLD2[spec])


@pytest.mark.parametrize("spec", sorted(WORLD4))
def test_build_mesh_world4(spec):
    _check_probe(get_rank_pool(4).run(_probe_mesh, spec), WORLD4[spec])


def test_build_mesh_infers_dp_shard_on_real_ranks():
    _check_probe(get_rank_pool(4).run(_probe_mesh, "t2"), WORLD4["d2t2"])


def test_build_mesh_validates_against_the_real_world_size():
    messages = get_rank_pool(4).run(_build_error, "d2t4")
    assert len(set(messages)) == 1
    assert "= 8, but world_size=4" in messages[0] and "divisors of 4: [1, 2, 4]" in messages[0]
    assert get_rank_pool(4).run(_build_error, "d4e3")[0].startswith("ep=3 must divide dp_shard*cp*tp=4")


# ---------------------------------------------------------------------------------------------- pool behaviour
def test_init_distributed_is_a_noop_when_initialised():
    results = get_rank_pool(4).run(_init_is_noop)
    assert results == [((r, 4), True, "gloo") for r in range(4)]


def test_results_come_back_in_rank_order_with_args_and_kwargs():
    results = get_rank_pool(4).run(_slow_low_ranks, 7, y="why")
    assert [r[:3] for r in results] == [(r, 7, "why") for r in range(4)]
    pids = [r[3] for r in results]
    assert len(set(pids)) == 4 and os.getpid() not in pids
    # the pool is reused: the same worker processes answer the next call
    assert [r[3] for r in get_rank_pool(4).run(_slow_low_ranks, 0, y="")] == pids


def test_get_rank_pool_is_shared():
    assert get_rank_pool(2) is get_rank_pool(2)
    assert get_rank_pool(2) is not get_rank_pool(4)
    assert get_rank_pool(4).world_size == 4


def test_rank_failure_carries_the_traceback_and_pool_recovers():
    pool = get_rank_pool(2)
    with pytest.raises(RankFailure) as info:
        pool.run(_fail_on_rank_one, "tagged")
    failure = info.value
    assert sorted(failure.errors) == [1]
    text = failure.errors[1]
    assert "Traceback (most recent call last)" in text
    assert "ValueError: boom from rank 1 (tagged)" in text
    assert "_fail_on_rank_one" in text
    assert str(failure).startswith("_fail_on_rank_one failed on rank(s) [1]:")
    assert "--- rank 1 ---" in str(failure) and "--- rank 0 ---" not in str(failure)
    # the next call works (on restarted workers)
    assert pool.run(_rank_and_world) == [(0, 2), (1, 2)]


def test_run_on_ranks_throwaway_pool():
    results = run_on_ranks(_init_is_noop, 2)
    assert results == [((0, 2), True, "gloo"), ((1, 2), True, "gloo")]


def test_pool_starts_again_on_a_new_port_when_its_port_was_taken(monkeypatch):
    """Between picking the port and rank 0 binding it (after the spawn) another process may take it."""
    import socket

    from shardforge.mesh.testing import pool as pool_module

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    real = pool_module.free_port
    ports = iter([busy])
    picked: list[int] = []

    def pick() -> int:
        picked.append(next(ports, None) or real())
        return picked[-1]

    monkeypatch.setattr(pool_module, "free_port", pick)
    try:
        assert run_on_ranks(_init_is_noop, 2) == [((0, 2), True, "gloo"), ((1, 2), True, "gloo")]
    finally:
        taken.close()
    assert len(picked) == 2 and picked[0] == busy != picked[1]  # the taken port, then a new one
