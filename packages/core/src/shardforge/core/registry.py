"""One tiny generic registry: a name picks a function or class from a table (STYLE.md 14).

    POLICY_LOSSES = Registry("policy loss")

    @POLICY_LOSSES.register("vanilla")
    def vanilla_policy_loss(...): ...

    POLICY_LOSSES.get("vanilla")          # the function
    POLICY_LOSSES.get("my_pkg.losses:mine")   # a user's, by import path (imported on first use)
    POLICY_LOSSES.get("typo")             # ValueError listing every registered name

Entries can also be registered lazily by import path (``register_lazy``) so that looking a
name up imports only the module that defines it (the vLLM rollout engine is never imported
by a run that does not ask for it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry", "all_registries", "import_path"]

T = TypeVar("T")

_REGISTRIES: list[Registry[object]] = []


def import_path(path: str) -> object:
    """The object named by ``"package.module:attribute"`` (the attribute may be dotted), or by
    ``"path/to/file.py:attribute"`` (a Python file, relative to the working directory, loaded once)."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path; write it as 'package.module:name' or 'file.py:name'")
    try:
        obj: object = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} of {path!r}: {err}") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj


def _load_file(file: str) -> object:
    import importlib.util
    import os
    import sys

    resolved = os.path.realpath(file)
    name = f"_shardforge_user_{abs(hash(resolved)):x}"
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(resolved):
        raise ImportError(f"no such file: {resolved}")
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"{resolved} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Registry(Generic[T]):
    """Names -> objects of one kind (policy losses, estimators, trainers, ...).

    Args:
        kind: what the entries are, for messages ("advantage estimator").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}
        self._docs: dict[str, str] = {}
        _REGISTRIES.append(self)  # type: ignore[arg-type]

    def register(self, name: str, *, doc: str | None = None) -> Callable[[T], T]:
        """Decorator: register the decorated function or class under ``name``."""

        def decorate(obj: T) -> T:
            self.add(name, obj, doc=doc)
            return obj

        return decorate

    def add(self, name: str, obj: T, *, doc: str | None = None) -> None:
        """Register ``obj`` under ``name``; a name can be registered once."""
        if name in self._entries or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is already registered; pick another name")
        if ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must not contain ':' (that marks an import path)")
        self._entries[name] = obj
        self._docs[name] = doc if doc is not None else _first_line(getattr(obj, "__doc__", None))

    def register_lazy(self, name: str, path: str, doc: str) -> None:
        """Register ``name`` as ``"package.module:attribute"``, imported on first `get`."""
        if name in self._entries or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is already registered; pick another name")
        self._lazy[name] = path
        self._docs[name] = doc

    def get(self, name: str) -> T:
        """The entry registered as ``name``, or the object at import path ``name`` (``pkg.mod:attr``)."""
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            obj = import_path(self._lazy[name])
            self._entries[name] = obj  # type: ignore[assignment]
            return obj  # type: ignore[return-value]
        if ":" in name:
            return import_path(name)  # type: ignore[return-value]
        raise ValueError(
            f"unknown {self.kind} {name!r}; registered: {self.names()} (or a user's, as 'package.module:name')"
        )

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted({*self._entries, *self._lazy})

    def describe(self) -> Iterator[tuple[str, str]]:
        """(name, one-line description) of every entry, sorted by name."""
        for name in self.names():
            yield name, self._docs.get(name, "")


def all_registries() -> list[Registry[object]]:
    """Every registry created so far (for `shardforge list`)."""
    return list(_REGISTRIES)


def _first_line(doc: str | None) -> str:
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""
