"""Build meshes for world sizes you cannot spawn, using torch's fake process-group backend.

No processes, no communication: collectives are no-ops, so this is for mesh *logic*
(coordinates, group membership, validation), never for numerics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from shardforge.mesh.dims import ParallelDims
from shardforge.mesh.mesh import ParallelMesh, build_mesh

__all__ = ["fake_mesh", "fake_process_group"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Initialise a fake default process group as ``rank`` of ``world_size`` for the block."""
    # The fake backend registers itself when this private module is imported.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; fake_process_group needs none")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, {world_size})")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_mesh(dims: ParallelDims, world_size: int, rank: int = 0) -> Iterator[ParallelMesh]:
    """Yield ``build_mesh(dims)`` as seen from ``rank`` in a fake world of ``world_size``."""
    with fake_process_group(world_size, rank):
        yield build_mesh(dims, device_type="cpu")
