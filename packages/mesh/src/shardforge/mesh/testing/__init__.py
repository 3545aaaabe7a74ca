"""Test helpers: run functions on N local gloo ranks, and build meshes on a fake backend."""

from shardforge.mesh.testing.fake import fake_mesh, fake_process_group
from shardforge.mesh.testing.pool import RankFailure, RankPool, get_rank_pool, run_on_ranks

__all__ = ["RankFailure", "RankPool", "fake_mesh", "fake_process_group", "get_rank_pool", "run_on_ranks"]
