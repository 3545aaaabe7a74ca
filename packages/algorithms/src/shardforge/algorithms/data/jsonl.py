"""JSONL reading with errors a user can act on: the file, the 1-based line, and what was expected.

Every data loader (SFT rows, preference pairs, prompts) and the CLI's pre-launch check read
through `read_jsonl`, so a malformed line is reported the same way everywhere, before training.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RowFields", "check_row_fields", "iter_jsonl", "read_jsonl"]

RowFields = Sequence[Sequence[str]]
"""Accepted row shapes: each entry is one set of keys a row may have, e.g.
``(("prompt", "completion"), ("messages",))``; an empty sequence accepts any object."""


def iter_jsonl(path: str | Path, what: str = "data file") -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, row)`` for every non-blank line (1-based numbers).

    Raises `FileNotFoundError` for a missing file and `ValueError` naming the file and line for
    a line that is not a JSON object.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno}); each line of a JSONL "
                    f'{what} must be one JSON object, e.g. {{"prompt": "1+1=", "completion": "2"}}'
                ) from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object ({{...}}), got {type(row).__name__}")
            yield number, row


_KEPT: dict[tuple[Any, ...], list[tuple[int, dict[str, Any]]]] = {}
"""Rows read with ``keep=True``, by file identity and fields, until this process reads them again."""


def _file_key(path: Path, fields: RowFields) -> tuple[Any, ...]:
    stat = path.stat()
    return str(path.resolve()), stat.st_mtime_ns, stat.st_size, tuple(tuple(keys) for keys in fields)


def read_jsonl(
    path: str | Path, what: str = "data file", fields: RowFields = (), *, keep: bool = False
) -> list[tuple[int, dict[str, Any]]]:
    """All rows of a JSONL file as ``(line_number, row)``; an empty file is a `ValueError`.

    ``fields`` (see `RowFields`) checks that each row has one of the accepted key sets. ``keep``: also
    hold the rows for this process's next read of the same unchanged file with the same ``fields``, which
    takes them instead of parsing the file again (the CLI's pre-launch check in a one-process run, where
    the trainer then reads the same file: 9,800 demo rows were parsed twice).
    """
    path = Path(path)
    key = _file_key(path, fields) if path.is_file() else None
    rows = _KEPT.pop(key, None) if key is not None else None
    if rows is None:
        rows = []
        for number, row in iter_jsonl(path, what):
            check_row_fields(row, fields, f"{path}:{number}")
            rows.append((number, row))
        if not rows:
            raise ValueError(f"{what} {str(path)!r} is empty (no JSON lines); expected one JSON object per line")
    if keep and key is not None:
        _KEPT[key] = list(rows)
    return rows


def check_row_fields(row: dict[str, Any], fields: RowFields, where: str) -> None:
    """Raise `ValueError` unless ``row`` has (non-null) all keys of one of the accepted sets."""
    if not fields:
        return
    present = {k for k, v in row.items() if v is not None}
    if any(set(keys) <= present for keys in fields):
        return
    expected = " or ".join("+".join(repr(k) for k in keys) for keys in fields)
    raise ValueError(f"{where}: the row has fields {sorted(present)}; expected {expected}")
