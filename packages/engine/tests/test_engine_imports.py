"""shardforge-engine neither needs nor imports what only the algorithms package uses: datasets, pyyaml (``yaml``),
tqdm, tensorboard, matplotlib (issue 37).

What torch and transformers do on their own (measured with torch 2.13.0 and transformers 5.19.0, each in a fresh
process):

- ``import torch`` loads tqdm when it is installed (torch/hub.py: ``try: from tqdm import tqdm``), without
  declaring it;
- ``import transformers`` loads tqdm (transformers/utils/logging.py) and yaml (huggingface_hub/utils/_fixes.py),
  and transformers and huggingface-hub declare pyyaml and tqdm: every venv holding shardforge-engine has both
  installed, and never datasets, tensorboard or matplotlib;
- importing shardforge.engine and every module in it loads torch (so tqdm where installed) but not transformers,
  which the engine imports where it loads a model.

So the tests assert what is ours: no module of ours imports any of the five (each import of one is attributed to
the module executing it), importing the engine loads none of them beyond what ``import torch`` and
``import transformers`` load in the same venv, and neither shardforge-engine nor a shardforge package below it
declares them. The workspace venv, where all five are installed, and ``nox -s isolation``'s venv for this package
(shardforge-engine, its dependencies and its ``[test]`` extra) both run these tests.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

HEAVY = ("datasets", "yaml", "tqdm", "tensorboard", "matplotlib")
HEAVY_DISTRIBUTIONS = ("datasets", "pyyaml", "tqdm", "tensorboard", "matplotlib")
MAIN = (
    "shardforge.engine.train_engine",
    "shardforge.engine.objectives",
    "shardforge.engine.batching",
    "shardforge.engine.build",
)

# Records who imports a HEAVY module: every import statement (builtins.__import__, even of a module already
# loaded) and every first import (a meta-path finder: importlib.import_module too), by the importing module's name.
RECORDER = (
    f"HEAVY = set({HEAVY!r})\n"
    + """
import builtins, json, sys

importers = {}


def _note(name, frame):
    top = name.split(".")[0]
    if top not in HEAVY:
        return
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_globals.get("__name__", "").startswith("importlib")
                                 or frame.f_code is _recording_import.__code__):
        frame = frame.f_back
    importer = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    importers.setdefault(top, set()).add(importer)


_import = builtins.__import__


def _recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0:
        _note(name, sys._getframe(1))
    return _import(name, globals, locals, fromlist, level)


class _Finder:
    def find_spec(self, name, path=None, target=None):
        _note(name, sys._getframe(1))
        return None


builtins.__import__ = _recording_import
sys.meta_path.insert(0, _Finder())


def report(**extra):
    loaded = sorted({m.split(".")[0] for m in sys.modules} & HEAVY)
    print(json.dumps({"loaded": loaded, "importers": {k: sorted(v) for k, v in importers.items()}, **extra}))
"""
)

ENGINE = (
    RECORDER
    + f"MAIN = {MAIN!r}\n"
    + """
import importlib, pkgutil

for name in MAIN:
    importlib.import_module(name)
import shardforge.engine

modules = [info.name for info in pkgutil.walk_packages(shardforge.engine.__path__, "shardforge.engine.")]
for name in modules:
    importlib.import_module(name)
ours = sorted(m for m in sys.modules if m.startswith("shardforge."))
report(modules=modules, ours=ours, files={m: sys.modules[m].__file__ for m in ours},
       transformers="transformers" in sys.modules)
"""
)

BASELINE = RECORDER + "\nimport torch\nimport transformers\nreport()\n"


def _run(code: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def engine() -> dict[str, Any]:
    """What importing shardforge.engine and every module in it does, in a fresh process."""
    return _run(ENGINE)


def test_importing_the_engine_loads_nothing_heavy_beyond_torch_and_transformers(engine: dict[str, Any]) -> None:
    baseline = _run(BASELINE)
    assert set(MAIN) <= set(engine["modules"])
    # The first importer of each: in this venv, never a module of ours (torch / transformers / huggingface_hub).
    ours = {heavy: [m for m in who if m.startswith("shardforge")] for heavy, who in engine["importers"].items()}
    assert all(not who for who in ours.values()), f"modules of ours import {ours}"
    assert set(engine["loaded"]) <= set(baseline["loaded"]), (
        f"importing shardforge.engine loads {engine['loaded']}; import torch + transformers alone: {baseline['loaded']}"
    )
    assert not {"datasets", "tensorboard", "matplotlib"} & set(engine["loaded"])


def test_no_import_statement_of_ours_names_a_heavy_library(engine: dict[str, Any]) -> None:
    """Function-level imports too, in the engine and every shardforge module it loads."""
    files = engine["files"]
    offenders = []
    for module, file in sorted(files.items()):
        if not file:
            continue
        path = Path(file)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{module}:{node.lineno}: {name}" for name in names if name.split(".")[0] in HEAVY]
    assert offenders == []


def _requirement_names(distribution: str) -> list[str]:
    requires = importlib.metadata.requires(distribution) or []
    return [re.split(r"[^A-Za-z0-9._-]", r.strip(), maxsplit=1)[0].lower() for r in requires if "extra ==" not in r]


def test_neither_the_engine_nor_a_package_below_it_declares_a_heavy_library() -> None:
    seen: set[str] = set()
    todo = ["shardforge-engine"]
    declared: dict[str, list[str]] = {}
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        declared[dist] = _requirement_names(dist)
        todo += [name for name in declared[dist] if name.startswith("shardforge-")]
    assert {"shardforge-core", "shardforge-mesh", "shardforge-lora"} <= seen
    assert {dist: sorted(set(names) & set(HEAVY_DISTRIBUTIONS)) for dist, names in declared.items()} == {
        dist: [] for dist in declared
    }
