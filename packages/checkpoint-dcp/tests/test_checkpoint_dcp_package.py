"""Packaging checks: version, public surface, and the dependency boundary."""

import importlib.metadata
import subprocess
import sys

import shardforge.checkpoint_dcp as pkg


def test_version_matches_distribution() -> None:
    assert pkg.__version__ == importlib.metadata.version("shardforge-checkpoint-dcp")


def test_public_surface() -> None:
    assert sorted(pkg.__all__) == [
        "COMMIT_MARKER",
        "AsyncMode",
        "Checkpointer",
        "TrainState",
        "capture_rng_state",
        "check_compatible",
        "checkpoint_tensor_shapes",
        "convert_dcp_to_hf",
        "export_hf",
        "load_hf",
        "restore_rng_state",
        "write_safetensors_shards",
    ]
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None
    assert pkg.COMMIT_MARKER == "COMMITTED"


def test_import_pulls_in_no_other_shardforge_package_or_transformers() -> None:
    code = (
        "import sys, shardforge.checkpoint_dcp, shardforge.checkpoint_dcp.convert\n"
        "bad = sorted(m for m in sys.modules if m == 'transformers' or (m.startswith('shardforge.')"
        " and not m.startswith(('shardforge.checkpoint_dcp', 'shardforge.mesh'))))\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_mesh_dependency_imports() -> None:
    from shardforge.mesh import ParallelDims

    assert ParallelDims.parse("d2").dp_shard == 2
