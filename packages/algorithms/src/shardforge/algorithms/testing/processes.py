"""Which processes are alive, read from Linux ``/proc``: for tests that check a run leaves none behind."""

from __future__ import annotations

from pathlib import Path

__all__ = ["alive", "descendants", "process_table", "session_processes"]


def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat`` after ``pid (comm)``: state, ppid, pgrp, session, ... (None: gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses


def process_table() -> dict[int, tuple[int, int]]:
    """Every live (non-zombie) process: pid -> (parent pid, session id)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if fields is not None and fields[0] != "Z":
                table[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return table


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a command started with ``start_new_session`` and what it started in it)."""
    return [pid for pid, (_, session) in process_table().items() if session == sid]


def descendants(root: int) -> list[int]:
    """Live processes below ``root``, at any depth (torch's agent starts each rank in a session of its own)."""
    table = process_table()
    found, frontier = [], {root}
    while frontier:
        children = {pid for pid, (parent, _) in table.items() if parent in frontier}
        found += sorted(children)
        frontier = children
    return found
