"""Named hook points: production code fires them, tests (or a user's tooling) fill them.

A lower layer must not import a test helper to be testable (STYLE.md 20). It fires a named point instead,

    hooks.fire("step_end", step=step)

and whoever wants to act there registers a function for it, in process

    hooks.register("step_end", my_fn)

or, for processes the test cannot reach (torchrun ranks, Ray actors), by naming modules in the
``SHARDFORGE_HOOKS`` environment variable (comma-separated): each is imported at the first `fire` of the
process and registers its hooks on import (`shardforge.algorithms.testing.fault_injection` does). With nothing
registered and the variable unset, `fire` is a dictionary lookup.

Points fired today (keyword arguments in brackets):

- ``step_start`` (step): a trainer is about to run step ``step`` (1-based);
- ``step_end`` (step): step ``step`` is done and its checkpoint, if one was due, is committed;
- ``rollout_generate`` (index, call): rollout actor ``index`` is in its ``call``-th generate call (1-based);
- ``checkpoint_write`` (rank, path): a rank is about to write its files of the checkpoint being staged in ``path``
  (inside the checkpoint's collective write: an exception raised here fails the save on every rank, as a full disk
  would; `shardforge serve`'s ``save_state``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

__all__ = ["HOOKS_ENV", "POINTS", "clear", "fire", "register"]

HOOKS_ENV = "SHARDFORGE_HOOKS"
POINTS = ("step_start", "step_end", "rollout_generate", "checkpoint_write")

_hooks: dict[str, list[Callable[..., Any]]] = {}
_loaded: set[str] = set()


def register(point: str, fn: Callable[..., Any]) -> None:
    """Call ``fn(**kwargs)`` whenever ``point`` fires in this process (after the functions registered before it)."""
    if point not in POINTS:
        raise ValueError(f"unknown hook point {point!r}; valid: {list(POINTS)}")
    _hooks.setdefault(point, []).append(fn)


def clear(point: str | None = None) -> None:
    """Forget the functions registered for ``point`` (every point when None)."""
    if point is None:
        _hooks.clear()
    else:
        _hooks.pop(point, None)


def fire(point: str, **kwargs: Any) -> None:
    """Run the functions registered for ``point`` with ``kwargs``, in registration order."""
    if point not in POINTS:  # a typo would silently never fire
        raise ValueError(f"unknown hook point {point!r}; valid: {list(POINTS)}")
    _load_from_env()
    for fn in _hooks.get(point, ()):
        fn(**kwargs)


def _load_from_env() -> None:
    for name in os.environ.get(HOOKS_ENV, "").split(","):
        name = name.strip()
        if name and name not in _loaded:
            _loaded.add(name)
            try:
                importlib.import_module(name)
            except ImportError as err:
                raise ImportError(
                    f"{HOOKS_ENV}={os.environ[HOOKS_ENV]!r}: cannot import hook module {name!r}: {err}"
                ) from err
