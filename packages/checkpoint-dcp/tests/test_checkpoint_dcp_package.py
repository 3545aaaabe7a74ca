"""Packaging checks: version, public surface, and the dependency boundary."""

import ast
import importlib.metadata
import sys
from pathlib import Path

import shardforge.checkpoint_dcp as pkg


def test_version_matches_distribution() -> None:
    assert pkg.__version__ == importlib.metadata.version("shardforge-checkpoint-dcp")


def test_public_surface() -> None:
    assert len(pkg.__all__) == len(set(pkg.__all__))
    assert set(pkg.__all__) == {
        "COMMIT_MARKER",
        "AsyncMode",
        "Checkpointer",
        "CorruptCheckpointError",
        "TrainState",
        "TrainableState",
        "capture_rng_state",
        "check_compatible",
        "checkpoint_tensor_shapes",
        "convert_dcp_to_hf",
        "export_hf",
        "load_hf",
        "restore_rng_state",
        "verify_files",
        "write_hf_dir",
        "write_safetensors_shards",
    }
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None
    assert pkg.COMMIT_MARKER == "COMMITTED"


def test_imports_stay_inside_the_declared_dependencies() -> None:
    # Only torch, safetensors, shardforge.mesh and the standard library (numpy optionally):
    # transformers and other shardforge packages are not dependencies of this package.
    allowed = {"torch", "safetensors", "numpy", "shardforge.checkpoint_dcp", "shardforge.mesh"}
    found = set()
    for file in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
    third_party = {m for m in found if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"}
    assert third_party, "no imports found: the scan is broken"
    bad = sorted(m for m in third_party if not any(m == a or m.startswith(a + ".") for a in allowed))
    assert bad == []


def test_mesh_dependency_imports() -> None:
    from shardforge.mesh import ParallelDims

    assert ParallelDims.parse("d2").dp_shard == 2
