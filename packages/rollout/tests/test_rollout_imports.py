"""shardforge.rollout never imports the training side (DESIGN.md section 2: rollout does not know engine;
algorithms sits above both): importing the package and every module in it, in a fresh process, loads no
``shardforge.engine`` or ``shardforge.algorithms`` module, and no import statement in its sources (function-level
and ``TYPE_CHECKING`` ones included) names them.

The vllm/ and ray/ modules import vLLM and Ray only when an engine or actor is built; should one of them come to
need its optional dependency at import, it is left out of the walk (reported in ``skipped``) rather than failing
here."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

FORBIDDEN = ("shardforge.engine", "shardforge.algorithms")

SCRIPT = """
import importlib, json, pkgutil, sys

import shardforge.rollout

# extras: [vllm], [ray], [openai], [verifiers], [openenv]
OPTIONAL = {"vllm", "ray", "fastapi", "uvicorn", "openai", "verifiers", "openenv", "websockets", "fastmcp"}
imported, skipped = [], []
for info in pkgutil.walk_packages(shardforge.rollout.__path__, "shardforge.rollout.", onerror=lambda name: None):
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in OPTIONAL:
            raise
        skipped.append(info.name)
    else:
        imported.append(info.name)
print(json.dumps({"imported": imported, "skipped": skipped, "loaded": sorted(sys.modules)}))
"""

# The modules issue 37 names: the package's public surface, none of which needs an optional dependency.
REQUIRED = (
    "shardforge.rollout.factory",
    "shardforge.rollout.types",
    "shardforge.rollout.workflows",
    "shardforge.rollout.workflows.rlvr",
    "shardforge.rollout.workflows.multi_turn",
    "shardforge.rollout.workflows.tool_use",
    "shardforge.rollout.hf.engine",
    "shardforge.rollout.episodes.request_queue",
    "shardforge.rollout.episodes.trajectory",
    "shardforge.rollout.server.health",
    "shardforge.rollout.server.http",
    "shardforge.rollout.server.shared_restart",
)


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_importing_every_rollout_module_loads_no_engine_or_algorithms_module() -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    missing = [name for name in REQUIRED if name not in result["imported"]]
    assert not missing, f"not imported: {missing} (skipped for an optional dependency: {result['skipped']})"
    assert [name for name in result["loaded"] if _forbidden(name)] == []


def test_no_import_statement_in_rollout_names_engine_or_algorithms() -> None:
    spec = importlib.util.find_spec("shardforge.rollout")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            offenders += [f"{path.relative_to(root)}:{node.lineno}: {name}" for name in names if _forbidden(name)]
    assert offenders == []
