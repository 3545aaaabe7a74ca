"""`build_mesh` layout logic on torch's fake backend (no processes): group membership for many shapes.

Expected groups are computed here from first principles: the world is ``arange(W)`` laid out
row-major as ``[pp, dp_replicate, dp_shard, cp, tp]``; a dense axis's group varies that one
coordinate; a derived axis varies several and is flattened row-major; the expert pool is the
flattened ``(dp_shard, cp[, tp if etp == 1])`` group, split as ``(efsdp, ep)`` (ep innermost);
with ``ep == 1`` efsdp is simply fsdp.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from shardforge.mesh import ParallelDims, build_mesh
from shardforge.mesh.testing import fake_mesh, fake_process_group

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh:UserWarning")

LAYOUT_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
COMPONENTS = {
    "pp": ("pp",),
    "dp_replicate": ("dp_replicate",),
    "dp_shard": ("dp_shard",),
    "cp": ("cp",),
    "tp": ("tp",),
    "dp": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
ALL_AXES = (*COMPONENTS, "ep", "efsdp")


def _grid(dims: ParallelDims) -> np.ndarray:
    shape = [dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp]
    return np.arange(int(np.prod(shape))).reshape(shape)


def _vary(dims: ParallelDims, rank: int, parts: tuple[str, ...]) -> list[int]:
    """Ranks that share ``rank``'s coordinates on every axis except ``parts`` (row-major order)."""
    grid = _grid(dims)
    coord = np.unravel_index(rank, grid.shape)
    index = tuple(slice(None) if name in parts else int(c) for name, c in zip(LAYOUT_ORDER, coord))
    return grid[index].ravel().tolist()


def expert_pool(dims: ParallelDims, rank: int) -> list[int]:
    return _vary(dims, rank, ("dp_shard", "cp", "tp") if dims.etp == 1 else ("dp_shard", "cp"))


def expected_group(dims: ParallelDims, rank: int, axis: str) -> list[int]:
    if axis in COMPONENTS:
        return _vary(dims, rank, COMPONENTS[axis])
    if dims.ep == 1:  # no expert parallelism: experts shard like dense parameters
        return [rank] if axis == "ep" else _vary(dims, rank, COMPONENTS["fsdp"])
    pool = expert_pool(dims, rank)
    pos = pool.index(rank)
    if axis == "ep":  # contiguous inner block of the pool
        start = pos - pos % dims.ep
        return pool[start : start + dims.ep]
    assert axis == "efsdp"  # strided outer part: same position inside every ep block
    return pool[pos % dims.ep :: dims.ep]


def sample_ranks(world: int) -> list[int]:
    return sorted({0, world - 1, world // 2 + 1, (5 * world) // 7, 5} & set(range(world)))


SHAPES = [
    # world 8
    ("d8", 8),
    ("r2d4", 8),
    ("d4t2", 8),
    ("d2c2t2", 8),
    ("p2d2t2", 8),
    ("r2d2c2", 8),
    ("r2t4", 8),
    ("t8", 8),
    ("p8", 8),
    ("c8e4", 8),
    ("d2t4e2", 8),
    ("d4t2e4", 8),
    ("d4t2e2x2", 8),
    ("t2", 8),  # dp_shard inferred = 4
    # world 16
    ("r2d2c2t2", 16),
    ("d4c2t2e4", 16),
    ("d4c2t2e4x2", 16),
    ("d4c2t2e16", 16),
    ("p2r2d2t2e2x2", 16),
    ("d16e16", 16),
    ("c2t2", 16),  # dp_shard inferred = 4
    # world 64
    ("p2r2d4c2t2e8", 64),
    ("r4d4t4e4x4", 64),
    ("d8t8e8", 64),
    ("d64e8", 64),
    ("p2c4t2", 64),
    # world 512
    ("p4r2d8c2t4e16", 512),
    ("p8d8t8e4x8", 512),
    ("r8d8c8e2", 512),
    # world 1024
    ("d1024", 1024),
    ("r4d8c4t4p2e8", 1024),
    ("p4r4d4c4t4e32", 1024),
    ("d1024e64", 1024),
    ("r2c4t8e16x8", 1024),
]


@pytest.mark.parametrize(("spec", "world"), SHAPES, ids=[f"{s}-w{w}" for s, w in SHAPES])
def test_axis_groups_follow_row_major_layout(spec, world):
    dims = ParallelDims.parse(spec).resolve(world)
    for rank in sample_ranks(world):
        with fake_mesh(ParallelDims.parse(spec), world, rank) as mesh:
            assert mesh.rank == rank
            assert mesh.dims == dims
            assert mesh.world.mesh.numel() == world
            for axis in ALL_AXES:
                group = expected_group(dims, rank, axis)
                where = f"{spec} world={world} rank={rank} axis={axis}"
                assert mesh.size(axis) == len(group), where
                assert mesh.size(axis) == dims.size(axis), where
                if len(group) == 1:
                    assert not mesh.has(axis), where
                    assert mesh.local_rank(axis) == 0, where
                    with pytest.raises(ValueError, match=rf"axis '{axis}' has size 1 .*mesh\.has\('{axis}'\)"):
                        mesh.get(axis)
                    continue
                assert mesh.has(axis), where
                sub = mesh.get(axis)
                assert sub.ndim == 1, where
                assert rank in sub.mesh.tolist(), where
                assert sub.mesh.tolist() == group, where
                assert dist.get_process_group_ranks(sub.get_group()) == group, where
                assert mesh.local_rank(axis) == group.index(rank), where
                assert sub.get_local_rank() == group.index(rank), where


def test_handwritten_groups_r2d2c2t2():
    """Anchor for the helper above: rank 5 of 16 is (r=0, d=1, c=0, t=1)."""
    with fake_mesh(ParallelDims.parse("r2d2c2t2"), 16, rank=5) as mesh:
        got = {axis: mesh.get(axis).mesh.tolist() for axis in ALL_AXES if mesh.has(axis)}
    assert got == {
        "dp_replicate": [5, 13],
        "dp_shard": [1, 5],
        "cp": [5, 7],
        "tp": [4, 5],
        "dp": [1, 5, 9, 13],
        "fsdp": [1, 3, 5, 7],
        "dp_cp": [1, 3, 5, 7, 9, 11, 13, 15],
        "efsdp": [1, 3, 5, 7],
    }


@pytest.mark.parametrize(
    ("spec", "ep", "efsdp"),
    [
        ("d4c2t2e4", [4, 5, 6, 7], [1, 5, 9, 13]),  # experts borrow dp_shard x cp x tp
        ("d4c2t2e4x2", [1, 3, 5, 7], [5, 13]),  # experts borrow dp_shard x cp only (tp stays with them)
        ("d4c2t2e16", list(range(16)), None),
    ],
)
def test_handwritten_expert_groups(spec, ep, efsdp):
    with fake_mesh(ParallelDims.parse(spec), 16, rank=5) as mesh:
        assert mesh.get("ep").mesh.tolist() == ep
        if efsdp is None:
            assert not mesh.has("efsdp")
        else:
            assert mesh.get("efsdp").mesh.tolist() == efsdp


EXPERT_SHAPES = [(s, w) for s, w in SHAPES if ParallelDims.parse(s).ep > 1]


@pytest.mark.parametrize(("spec", "world"), EXPERT_SHAPES, ids=[f"{s}-w{w}" for s, w in EXPERT_SHAPES])
def test_ep_is_inner_slice_and_efsdp_outer_stride_of_expert_pool(spec, world):
    dims = ParallelDims.parse(spec).resolve(world)
    for rank in sample_ranks(world):
        pool = expert_pool(dims, rank)
        with fake_mesh(dims, world, rank) as mesh:
            ep = mesh.get("ep").mesh.tolist()
            efsdp = mesh.get("efsdp").mesh.tolist() if mesh.has("efsdp") else [rank]
        assert len(ep) * len(efsdp) == len(pool)
        # ep: a contiguous, aligned block of the flattened pool
        start = pool.index(ep[0])
        assert start % len(ep) == 0
        assert pool[start : start + len(ep)] == ep
        # efsdp: every len(ep)-th pool rank, at this rank's offset inside its ep block
        assert efsdp == pool[ep.index(rank) :: len(ep)]
        assert set(ep) & set(efsdp) == {rank}
        if dims.etp > 1:  # experts are tp-sharded: the ep group never crosses a tp coordinate
            assert len({r % dims.tp for r in ep}) == 1


@pytest.mark.parametrize(("spec", "world"), [("r2d4c2t2", 32), ("d8", 8), ("p2c4", 8), ("d4t2x2", 8), ("r4t2", 8)])
def test_efsdp_equals_fsdp_when_ep_is_one(spec, world):
    for rank in sample_ranks(world):
        with fake_mesh(ParallelDims.parse(spec), world, rank) as mesh:
            assert not mesh.has("ep")
            assert mesh.size("efsdp") == mesh.size("fsdp")
            assert mesh.has("efsdp") == mesh.has("fsdp")
            if mesh.has("fsdp"):
                assert mesh.get("efsdp").mesh.tolist() == mesh.get("fsdp").mesh.tolist()


def test_world_of_one_has_no_axes():
    with fake_mesh(ParallelDims(), 1) as mesh:
        assert mesh.world.mesh.tolist() == [0]
        assert mesh.dims.dp_shard == 1
        for axis in ALL_AXES:
            assert mesh.size(axis) == 1
            assert not mesh.has(axis)
            assert mesh.local_rank(axis) == 0
            with pytest.raises(ValueError, match=r"has\("):
                mesh.get(axis)


def test_size_one_axis_error_names_layout_and_present_axes():
    with fake_mesh(ParallelDims.parse("d4t2"), 8) as mesh:
        with pytest.raises(ValueError, match=r"axis 'cp' has size 1 in layout r1d4c1t2p1e1x1") as info:
            mesh.get("cp")
    message = str(info.value)
    assert "check `mesh.has('cp')` first" in message
    assert "Present axes: ['dp', 'dp_cp', 'dp_shard', 'efsdp', 'fsdp', 'tp']" in message


def test_unknown_axis_lists_valid_axes():
    with fake_mesh(ParallelDims.parse("d4t2"), 8) as mesh:
        with pytest.raises(ValueError, match=r"unknown axis 'bogus'; valid axes: \[") as info:
            mesh.get("bogus")
        for name in ALL_AXES:
            assert f"'{name}'" in str(info.value)
        for call in (mesh.has, mesh.size, mesh.local_rank):
            with pytest.raises(ValueError, match=r"unknown axis 'bogus'; valid axes"):
                call("bogus")
        with pytest.raises(ValueError, match=r"unknown axis 'bogus'"):
            mesh.get(("tp", "bogus"))


# ---------------------------------------------------------------------------------------------- multi-axis get
@pytest.mark.parametrize(
    ("spec", "world", "axes"),
    [
        ("r2d2", 4, ("dp_replicate", "fsdp")),  # fsdp is dp_shard itself (cp == 1)
        ("r2d2c2", 8, ("dp_replicate", "fsdp")),  # fsdp is flattened dp_shard x cp
        ("r2d2c2t2", 16, ("dp_replicate", "fsdp")),
        ("r2d4t2", 16, ("dp_replicate", "dp_shard")),
        ("p2d2t2", 8, ("pp", "tp")),
        ("r2d2t2", 8, ("dp", "tp")),  # dp is flattened r x d
        ("d2t2", 4, ("dp", "tp")),  # dp is dp_shard itself
        ("p2r2d2c2t2", 32, ("pp", "dp_cp", "tp")),
    ],
)
def test_get_tuple_of_axes_is_the_2d_submesh(spec, world, axes):
    dims = ParallelDims.parse(spec).resolve(world)
    parts = tuple(p for axis in axes for p in COMPONENTS[axis])
    for rank in sample_ranks(world):
        expected = np.array(_vary(dims, rank, parts)).reshape([dims.size(a) for a in axes]).tolist()
        with fake_mesh(dims, world, rank) as mesh:
            sub = mesh.get(axes)
            assert sub.mesh.tolist() == expected, f"{spec} rank={rank}"


def test_get_single_element_tuple_is_the_axis():
    with fake_mesh(ParallelDims.parse("d2t2"), 4, rank=3) as mesh:
        assert mesh.get(("tp",)) is mesh.get("tp")
        assert mesh.get(["fsdp"]) is mesh.get("fsdp")


def test_get_tuple_with_absent_axis_raises():
    with fake_mesh(ParallelDims.parse("r2d2"), 4) as mesh, pytest.raises(ValueError, match=r"axis 'cp' has size 1"):
        mesh.get(("dp_replicate", "cp"))


# ---------------------------------------------------------------------------------------------- misc
def test_dp_shard_minus_one_is_resolved_against_world():
    with fake_mesh(ParallelDims(tp=2, cp=2), 32, rank=7) as mesh:
        assert mesh.dims == ParallelDims(dp_shard=8, tp=2, cp=2)
        assert mesh.size("dp_shard") == 8
        assert mesh.get("dp_shard").mesh.tolist() == [3, 7, 11, 15, 19, 23, 27, 31]


def test_invalid_layout_raises_and_leaves_no_process_group():
    with pytest.raises(ValueError, match=r"world_size=8 is not divisible by"):
        with fake_mesh(ParallelDims(tp=3), 8):
            pass
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"but world_size=8"):
        with fake_mesh(ParallelDims.parse("d4"), 8):
            pass
    assert not dist.is_initialized()


def test_device_type_and_repr():
    with fake_mesh(ParallelDims.parse("r2d2"), 4) as mesh:
        assert mesh.device_type == "cpu"
        text = repr(mesh)
    assert text.startswith("ParallelMesh(r2d2c1t1p1e1x1, {")
    assert "'dp_replicate': 2" in text and "'dp': 4" in text and "'cp'" not in text


def test_fake_mesh_cleans_up_after_exception_in_body():
    with pytest.raises(KeyError), fake_mesh(ParallelDims.parse("d4"), 4):
        raise KeyError("boom")
    assert not dist.is_initialized()


def test_fake_process_group_rank_and_world():
    with fake_process_group(64, rank=17):
        assert (dist.get_rank(), dist.get_world_size()) == (17, 64)
        mesh = build_mesh(ParallelDims.parse("d8t8"), device_type="cpu")
        assert mesh.get("tp").mesh.tolist() == list(range(16, 24))
    assert not dist.is_initialized()


@pytest.mark.parametrize("rank", [-1, 4, 100])
def test_fake_process_group_rejects_bad_rank(rank):
    with pytest.raises(ValueError, match=rf"rank={rank} must be in \[0, 4\)"), fake_process_group(4, rank):
        pass
    assert not dist.is_initialized()


def test_fake_process_group_refuses_nesting():
    with fake_process_group(2):
        with pytest.raises(RuntimeError, match=r"already initialised"), fake_process_group(2):
            pass
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_build_mesh_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"call shardforge.mesh.init_distributed\(\) first"):
        build_mesh(ParallelDims.parse("d2"))
