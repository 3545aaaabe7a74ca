"""Packaging checks for the planned (not yet implemented) package."""

import importlib.metadata

import shardforge.tensor_parallel as pkg


def test_version_matches_distribution() -> None:
    assert pkg.__version__ == importlib.metadata.version("shardforge-tensor-parallel")


def test_public_surface_is_empty_until_implemented() -> None:
    # The package must not pretend to offer an API it does not have yet.
    assert pkg.__all__ == []
    assert not [n for n in dir(pkg) if not n.startswith("_")]


def test_mesh_dependency_imports() -> None:
    from shardforge.mesh import ParallelDims

    assert ParallelDims.parse("d2").dp_shard == 2
