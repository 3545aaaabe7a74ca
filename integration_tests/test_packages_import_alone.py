"""Every package imports with only what its pyproject declares (the in-CI variant of ``nox -s isolation_imports``).

The test venv has every package and extra installed, so a package that imports an undeclared library (or a sibling
package it does not depend on) passes the suite and breaks for a user who installs that one wheel. Here each
package is imported in a subprocess where every installed distribution outside its declared dependency closure is
refused at import time (`import_alone.py`), then each of its submodules: a submodule may need one of the package's
extras, nothing else. ~5-15 s a package; `nox -s isolation_imports` (fresh venvs and real wheels, ~12 min) and
`nox -s isolation` (the packages' tests too) stay outside CI's budget.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # the suite imports test files by path (--import-mode=importlib)
from import_alone import normalize  # noqa: E402

PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


def _project(name: str) -> dict:
    return tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]


@functools.cache
def _closure(requirement: str) -> frozenset[str]:
    """The distribution of ``requirement`` and, installed here, everything it requires (with its named extras)."""
    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return frozenset()
    found = {normalize(req.name)}
    if normalize(req.name).startswith("shardforge-"):  # ours: the pyproject (an editable install's metadata can be old)
        project = _project(normalize(req.name).removeprefix("shardforge-"))
        requires = [*project.get("dependencies", [])]
        for extra in req.extras:
            requires += project.get("optional-dependencies", {}).get(extra, [])
        return frozenset(found.union(*(_closure(r) for r in requires)))
    try:
        requires = importlib.metadata.requires(req.name) or []
    except importlib.metadata.PackageNotFoundError:
        return frozenset(found)  # not installed here: nothing of it can be imported either
    for line in requires:
        sub = Requirement(line)
        wanted = sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras))
        if wanted:
            found |= _closure(str(Requirement(f"{sub.name}{'[' + ','.join(sub.extras) + ']' if sub.extras else ''}")))
    return frozenset(found)


def _spec(name: str) -> dict:
    project = _project(name)
    allowed = {normalize(project["name"])}
    for requirement in project.get("dependencies", []):
        allowed |= _closure(requirement)
    extras = {}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        if extra != "test":
            extras[extra] = sorted(set().union(*(_closure(r) for r in requirements)) - allowed)
    installed = {normalize(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    absent = sorted({d for dists in extras.values() for d in dists} - installed)
    module = "shardforge." + name.replace("-", "_")
    return {"module": module, "allowed": sorted(allowed), "extras": extras, "absent": absent}


def test_the_check_refuses_an_undeclared_import():
    """The finder must refuse what a lone install would lack: core declares no dependencies, so torch is refused."""
    code = (
        "import importlib.util, sys; sys.path.insert(0, sys.argv[1]); import import_alone as m; "
        "m.RefuseUndeclared.install({'shardforge-core'}); import shardforge.core\n"
        "print('find_spec:', importlib.util.find_spec('torch'))\n"
        "try:\n    import torch\nexcept ModuleNotFoundError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True, check=True
    ).stdout
    assert "find_spec: None" in out
    assert "refused: No module named 'torch'" in out


@pytest.mark.parametrize("name", PACKAGES)
def test_package_imports_with_its_declared_dependencies_only(name):
    spec = _spec(name)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("import_alone.py")), json.dumps(spec)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not result["errors"], f"shardforge-{name}:\n" + "\n".join(result["errors"])
