"""shardforge.mesh: parallel layout (`ParallelDims`), the named device mesh, and process-group start-up."""

from shardforge.mesh.dims import ParallelDims, divisors
from shardforge.mesh.distributed import (
    current_device,
    default_device_type,
    destroy_distributed,
    free_port,
    init_distributed,
)
from shardforge.mesh.dtypes import parse_dtype
from shardforge.mesh.mesh import DENSE_AXES, DERIVED_AXES, ParallelMesh, build_mesh

__version__ = "0.1.0"

__all__ = [
    "DENSE_AXES",
    "DERIVED_AXES",
    "ParallelDims",
    "ParallelMesh",
    "build_mesh",
    "current_device",
    "default_device_type",
    "destroy_distributed",
    "divisors",
    "free_port",
    "init_distributed",
    "parse_dtype",
]
