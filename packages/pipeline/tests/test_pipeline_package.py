"""Packaging checks: version, public surface, and the dependency boundary."""

import importlib.metadata
import subprocess
import sys

import shardforge.pipeline as pkg


def test_version_matches_distribution() -> None:
    assert pkg.__version__ == importlib.metadata.version("shardforge-pipeline")


def test_public_surface_is_all() -> None:
    public = sorted(
        n for n in dir(pkg) if not n.startswith("_") and n not in {"layout", "microbatch", "schedule", "stage"}
    )
    assert public == sorted(pkg.__all__)
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None


def test_does_not_import_other_feature_packages() -> None:
    # A fresh interpreter: the pytest process may already hold sibling packages.
    code = (
        "import sys, shardforge.pipeline; "
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('shardforge.')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['mesh', 'pipeline']" or out.strip() == "['pipeline']", out
