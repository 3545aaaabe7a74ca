"""shardforge-core has no dependencies: it declares none, and importing it (every module) and using its registry
and hook points loads no torch, in a fresh process, whether or not torch is installed (``nox -s isolation``
tests this package in a venv without torch; the workspace venv has torch). That includes a record that passes
`RankZeroFilter`: the rank comes from ``torch.distributed`` only where torch is already imported."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

SCRIPT = """
import importlib, json, pkgutil, sys

import shardforge.core

names = [info.name for info in pkgutil.walk_packages(shardforge.core.__path__, "shardforge.core.")]
for name in names:
    importlib.import_module(name)

from shardforge.core import Registry, get_logger, hooks

reg = Registry("thing")
reg.add("one", 1)
reg.register_lazy("join", "os.path:join", "os.path.join")
assert reg.get("one") == 1 and reg.get("join").__name__ == "join"
hooks.fire("step_end", step=1)
get_logger(__name__).debug("not emitted")
from shardforge.core import setup_logging
setup_logging()
get_logger("shardforge.check").info("emitted on rank 0 without asking torch")
print(json.dumps({"modules": names, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_core_loads_no_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert {"shardforge.core.hooks", "shardforge.core.log", "shardforge.core.registry"} <= set(result["modules"])
    assert result["torch"] == []


def test_core_declares_no_dependency() -> None:
    requires = importlib.metadata.requires("shardforge-core") or []
    assert [r for r in requires if "extra ==" not in r] == []
