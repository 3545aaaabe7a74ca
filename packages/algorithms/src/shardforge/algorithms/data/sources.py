"""Dataset sources: local JSONL/JSON/Parquet/CSV files, `datasets.save_to_disk` directories, folders of
data files, or HF dataset names (loaded by `datasets`, which reads its local cache when offline).

A source is a `SourceConfig` (YAML: ``{source: ..., split: ..., subset: ..., columns: {ours: theirs}}``)
or a plain path string. `read_source` returns ``(row_number, row)`` pairs (1-based; the line number for
JSONL, the row index + 1 otherwise) with the source's columns renamed to ours, so every loader reports
a bad row as ``<source> row <n>: field '<name>' ...``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardforge.algorithms.data.jsonl import RowFields, iter_jsonl

__all__ = [
    "OUR_COLUMNS",
    "SourceConfig",
    "as_source",
    "is_plain_jsonl",
    "read_rows",
    "read_source",
    "validate_row_types",
]

OUR_COLUMNS = ("prompt", "completion", "messages", "answer", "chosen", "rejected", "images")
"""The column names the trainers read; `SourceConfig.columns` maps a source's names onto these."""

_STRING_FIELDS = ("prompt", "completion", "answer", "chosen", "rejected")
_FILE_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    """One dataset: where it is, which split/subset, how its columns map to ours, and its mixture weight."""

    source: str
    """A local file (.jsonl, .json, .parquet, .csv), a `save_to_disk` directory, a folder of data files, or
    an HF dataset name such as ``openai/gsm8k`` (offline: must already be in the `datasets` cache). CSV
    columns are read as text."""
    split: str = "train"
    """Split to read (HF names, `save_to_disk` DatasetDicts and data folders); ignored for a single file."""
    subset: str | None = None
    """HF dataset config name (verl/TRL call it ``name``/``subset``), e.g. ``main`` for gsm8k."""
    columns: dict[str, str] = field(default_factory=dict)
    """Rename the source's columns to ours, ``{ours: theirs}``, e.g. ``{prompt: question, answer: answer}``;
    ours are prompt, completion, messages, answer, chosen, rejected, images."""
    weight: float = 1.0
    """Relative sampling weight inside ``data.mix`` (normalised over the mixture; 0 = skip this source)."""
    name: str | None = None
    """Label in logs, errors, the dry run and the checkpoint's per-source positions; default: ``source``."""

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"data source {self.source!r} must be a non-empty path or dataset name")
        if not isinstance(self.columns, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.columns.items()
        ):
            raise ValueError(
                f"{self.label}: columns must map our column names to the source's, e.g. "
                f"{{prompt: question}}; got {self.columns!r}"
            )
        unknown = sorted(set(self.columns) - set(OUR_COLUMNS))
        if unknown:
            raise ValueError(
                f"{self.label}: columns maps to unknown name(s) {unknown}; the keys are ours ({list(OUR_COLUMNS)}), "
                "the values the source's, e.g. {prompt: question}"
            )
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise ValueError(f"{self.label}: weight={self.weight!r} must be a finite number >= 0")
        if self.weight < 0:
            raise ValueError(f"{self.label}: weight={self.weight} is negative; weights must be >= 0 (0 skips a source)")

    @property
    def label(self) -> str:
        return self.name or self.source

    def describe(self) -> str:
        """One line for the dry run: the source, split/subset when they apply, the column mapping."""
        parts = [self.source]
        if not Path(self.source).is_file():
            parts.append(f"split={self.split}")
        if self.subset:
            parts.append(f"subset={self.subset}")
        if self.columns:
            parts.append("columns=" + ",".join(f"{k}<-{v}" for k, v in self.columns.items()))
        return " ".join(parts)


def as_source(value: str | SourceConfig) -> SourceConfig:
    """A plain path string as a `SourceConfig` (today's ``train_file: path.jsonl`` keeps working)."""
    return value if isinstance(value, SourceConfig) else SourceConfig(source=value)


def is_plain_jsonl(source: SourceConfig) -> bool:
    """A bare local ``.jsonl`` path (no name, no column mapping): read as before, errors as ``file:line``."""
    return source.name is None and not source.columns and source.source.endswith(".jsonl")


def read_source(spec: str | SourceConfig, fields: RowFields = ()) -> list[tuple[int, dict[str, Any]]]:
    """All rows of a source as ``(row_number, row)`` with columns renamed to ours.

    Raises `FileNotFoundError`/`ValueError` that name the source: a mapped column it lacks (listing the
    columns it has), rows without one of the accepted field sets ``fields``, a field of the wrong type.
    """
    spec = as_source(spec)
    path = Path(spec.source)
    if path.is_file() and path.suffix == ".jsonl":
        rows = list(iter_jsonl(path, f"data source {spec.label!r}"))
        found = sorted({k for _, row in rows for k in row})
    else:
        dataset = _load_dataset(spec, path)
        found = list(dataset.column_names)
        rows = [(i + 1, dict(row)) for i, row in enumerate(dataset)]
    if not rows:
        raise ValueError(f"data source {spec.label!r} has no rows (split={spec.split!r})")
    missing = {ours: theirs for ours, theirs in spec.columns.items() if theirs not in found}
    if missing:
        wanted = ", ".join(f"{theirs!r} (for {ours!r})" for ours, theirs in missing.items())
        raise ValueError(
            f"data source {spec.label!r} has no column {wanted}; its columns are {found}; fix columns: {{ours: theirs}}"
        )
    renamed = [(n, _rename(row, spec.columns)) for n, row in rows]
    columns = sorted({k for _, row in renamed for k in row})
    if fields and not any(set(keys) <= set(columns) for keys in fields):
        expected = " or ".join("+".join(repr(k) for k in keys) for keys in fields)
        raise ValueError(
            f"data source {spec.label!r} has columns {found}; expected {expected}; map yours with "
            f"columns: {{{fields[0][0]}: <your column>, ...}}"
        )
    for number, row in renamed:
        where = f"{spec.label} row {number}"
        _check_fields(row, fields, where)
        validate_row_types(row, where)
    return renamed


def validate_row_types(row: dict[str, Any], where: str) -> None:
    """Raise `ValueError` naming ``where`` and the field when a known field has the wrong type."""
    for key in _STRING_FIELDS:
        value = row.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {type(value).__name__} {value!r:.60}")
    messages = row.get("messages")
    if messages is None:
        return
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"{where}: field 'messages' item {i} must have 'role' and 'content', got {message!r:.80}")


def _check_fields(row: dict[str, Any], fields: RowFields, where: str) -> None:
    if not fields:
        return
    present = {k for k, v in row.items() if v is not None}
    if any(set(keys) <= present for keys in fields):
        return
    expected = " or ".join("+".join(repr(k) for k in keys) for keys in fields)
    empty = sorted(k for keys in fields for k in keys if k in row and row[k] is None)
    detail = f" (field {empty[0]!r} is empty)" if empty else ""
    raise ValueError(f"{where}: the row has fields {sorted(present)}{detail}; expected {expected}")


def _rename(row: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    if not columns:
        return row
    theirs = set(columns.values())
    out = {k: v for k, v in row.items() if k not in theirs}
    out.update({ours: row[name] for ours, name in columns.items()})
    return out


def _load_dataset(spec: SourceConfig, path: Path) -> Any:
    """A `datasets.Dataset` for a file, a `save_to_disk` directory, a data folder or an HF name."""
    import datasets

    try:
        if path.is_file():
            builder = _FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise ValueError(
                    f"data source {spec.label!r}: unknown file type {path.suffix!r}; "
                    f"use .jsonl, {', '.join(_FILE_BUILDERS)} or a dataset directory"
                )
            # CSV has no types: read every column as text ("12" stays a completion, not an int).
            extra = {"features": _csv_text_features(path), "keep_default_na": False} if builder == "csv" else {}
            return datasets.load_dataset(builder, data_files=str(path), split="train", **extra)
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if spec.split not in loaded:
                    raise ValueError(
                        f"data source {spec.label!r} has no split {spec.split!r}; its splits are {sorted(loaded)}"
                    )
                return loaded[spec.split]
            return loaded
        return datasets.load_dataset(spec.source, spec.subset, split=spec.split)
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as exc:
        if str(exc).startswith(f"data source {spec.label!r}"):
            raise
        kind = "directory" if path.is_dir() else ("file" if path.exists() else "dataset name")
        raise ValueError(
            f"data source {spec.label!r} ({kind}, split={spec.split!r}, subset={spec.subset!r}) could not be "
            f"loaded: {type(exc).__name__}: {exc}. A source is a local .jsonl/.json/.parquet/.csv file, a "
            "save_to_disk directory, a folder of data files, or an HF dataset name already in the local "
            "datasets cache (runs are offline: HF_HUB_OFFLINE=1)"
        ) from None


def _csv_text_features(path: Path) -> Any:
    import csv

    import datasets

    with path.open(newline="", encoding="utf-8") as handle:
        header = next(csv.reader(handle), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def read_rows(path: str | Path | SourceConfig, what: str, fields: RowFields) -> tuple[Any, Path, str]:
    """``(numbered rows, label, separator)`` of a JSONL file or a `SourceConfig`, for loaders whose errors
    name ``f"{label}{separator}{number}"`` (a file: ``path:line``; a source: ``name row N``)."""
    from shardforge.algorithms.data.jsonl import read_jsonl

    if isinstance(path, SourceConfig):
        return read_source(path, fields), Path(path.label), " row "
    return read_jsonl(Path(path), what, fields), Path(path), ":"
