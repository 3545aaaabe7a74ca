"""`build_mesh`: one `DeviceMesh` with named axes plus flattened views, built in one place.

Dense axes, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``. Only axes with
size > 1 become mesh dimensions, so an axis of size 1 creates no process group and costs
nothing; ask ``mesh.size(axis)`` / ``mesh.has(axis)`` before ``mesh.get(axis)``.

Derived views (flattened from the dense axes that exist):

    dp      dp_replicate x dp_shard        data loading
    fsdp    dp_shard x cp                  dense parameter sharding
    dp_cp   dp_replicate x dp_shard x cp   dense gradient averaging
    ep      expert parallel, the inner part of dp_shard x cp [x tp if etp == 1]
    efsdp   expert parameter sharding, the outer part of the same ranks (= fsdp when ep == 1)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardforge.mesh.dims import ParallelDims
from shardforge.mesh.distributed import default_device_type

__all__ = ["DENSE_AXES", "DERIVED_AXES", "ParallelMesh", "build_mesh"]

DENSE_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DERIVED_AXES: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
EXPERT_AXES: tuple[str, ...] = ("ep", "efsdp")


class ParallelMesh:
    """Named view over the world `DeviceMesh`; build it with `build_mesh`."""

    def __init__(self, dims: ParallelDims, world: DeviceMesh, views: dict[str, DeviceMesh]) -> None:
        self.dims = dims
        self.world = world
        self._views = views

    @property
    def device_type(self) -> str:
        return self.world.device_type

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def size(self, axis: str) -> int:
        """Size of ``axis`` (1 for axes absent from the mesh)."""
        return self.dims.size(axis)

    def has(self, axis: str) -> bool:
        """Whether ``axis`` is a mesh dimension (size > 1)."""
        self.dims.size(axis)  # validates the name
        return axis in self._views

    def local_rank(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` (0 on an axis of size 1)."""
        if not self.has(axis):
            return 0
        return self._views[axis].get_local_rank()

    def get(self, axis: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh for one axis or a tuple of axes (e.g. ``("dp_replicate", "fsdp")``)."""
        if isinstance(axis, str):
            self._check_present(axis)
            return self._views[axis]
        names = tuple(axis)
        if len(names) == 1:
            return self.get(names[0])
        for name in names:
            self._check_present(name)
        # A derived axis backed by a single dense axis (e.g. fsdp when cp == 1) is an alias of that
        # axis, not a dimension of the world mesh: slice the world by the view's own dimension name.
        return self.world[tuple(self._views[name].mesh_dim_names[0] for name in names)]  # type: ignore[index]

    def _check_present(self, axis: str) -> None:
        valid = sorted(set(DENSE_AXES) | set(DERIVED_AXES) | set(EXPERT_AXES))
        if axis not in valid:
            raise ValueError(f"unknown axis {axis!r}; valid axes: {valid}")
        if axis not in self._views:
            raise ValueError(
                f"axis {axis!r} has size 1 in layout {self.dims.to_string()} and is not part of the mesh "
                f"(size-1 axes create no process group); check `mesh.has({axis!r})` first. "
                f"Present axes: {sorted(self._views)}"
            )

    def __repr__(self) -> str:
        shape = {name: self.dims.size(name) for name in self._views}
        return f"ParallelMesh({self.dims.to_string()}, {shape})"


def build_mesh(dims: ParallelDims, device_type: str | None = None) -> ParallelMesh:
    """Build the world mesh and every named view for ``dims`` on the current process group.

    ``dims`` may have ``dp_shard=-1``; it is resolved against the world size. Every rank
    must call this with the same arguments (it creates process groups collectively).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs an initialised process group; call shardforge.mesh.init_distributed() first"
        )
    dims = dims.resolve(dist.get_world_size())
    device_type = device_type or default_device_type()
    present = [name for name in DENSE_AXES if dims.size(name) > 1]
    if not present:
        # World of one: keep a 1-element mesh so DTensor-based code has something to hold.
        world = init_device_mesh(device_type, (1,), mesh_dim_names=("world",))
        return ParallelMesh(dims, world, {})
    world = init_device_mesh(device_type, tuple(dims.size(n) for n in present), mesh_dim_names=tuple(present))
    views: dict[str, DeviceMesh] = {name: world[name] for name in present}
    for derived, parts in DERIVED_AXES.items():
        have = tuple(p for p in parts if p in views)
        if len(have) == 1:
            views[derived] = views[have[0]]
        elif len(have) > 1:
            views[derived] = world[have]._flatten(derived)
    _add_expert_views(dims, world, views)
    return ParallelMesh(dims, world, views)


def _add_expert_views(dims: ParallelDims, world: DeviceMesh, views: dict[str, DeviceMesh]) -> None:
    if dims.ep == 1:
        if "fsdp" in views:
            views["efsdp"] = views["fsdp"]
        return
    pool_parts = ("dp_shard", "cp") + (("tp",) if dims.etp == 1 else ())
    have = tuple(p for p in pool_parts if p in views)
    pool = views[have[0]] if len(have) == 1 else world[have]._flatten("_ep_pool")
    efsdp = dims.efsdp
    if efsdp == 1:
        views["ep"] = pool
        return
    split = pool._unflatten(0, (efsdp, dims.ep), ("efsdp", "ep"))
    views["efsdp"] = split["efsdp"]
    views["ep"] = split["ep"]
