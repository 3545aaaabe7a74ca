"""Python's cyclic garbage collector is paused while a `shardforge` process starts up (issue 25).

A rank's start-up (importing torch and transformers, reading and tokenising the data, building the
engine) makes millions of long-lived objects and almost no cyclic garbage, yet CPython 3.11 walks
them again and again: on the demo SFT (9,800 rows, 2 ranks on 2 cores) its collections took about a
fifth of a rank's wall time to the first step and more than half of its tokenisation (measured with
``gc.callbacks``; docs/benchmarks.md, issue 25). So `paused_gc` switches the collector off for
the start-up, and `end_startup_gc` (the trainer loop, just before the first step; the launcher,
before its agent waits for the ranks) moves everything start-up made to the permanent generation
(`gc.freeze`: never scanned again, as long-lived servers do after import) and switches it back on.
Nothing is collected differently for the training itself, and no result depends on it: reference
counting frees all non-cyclic garbage as before; cyclic garbage made during start-up waits.

When `paused_gc` ends (the command returns, e.g. in a test that calls ``cli.main`` in-process) the
objects it froze are unfrozen, so a long-lived caller collects them again.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["end_startup_gc", "paused_gc"]

_state = {"paused": False, "froze": False}


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the collector for the start-up of a command (no-op if it is already off); restore on exit."""
    if not gc.isenabled():  # the caller chose: leave it as it is
        yield
        return
    gc.disable()
    _state["paused"] = True
    try:
        yield
    finally:
        end_startup_gc()
        if _state["froze"]:
            gc.unfreeze()
            _state["froze"] = False


def end_startup_gc() -> None:
    """Start-up is over: freeze what it made and switch the collector back on (if `paused_gc` paused it)."""
    if not _state["paused"]:
        return
    if gc.get_freeze_count() == 0:  # someone else's freeze is theirs to undo: do not unfreeze it later
        gc.freeze()
        _state["froze"] = True
    _state["paused"] = False
    gc.enable()
