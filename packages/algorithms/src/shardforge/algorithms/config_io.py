"""Build nested frozen config dataclasses from YAML/dicts and ``a.b.c=value`` overrides."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = ["apply_overrides", "build_config", "config_to_dict", "describe_config", "field_docs", "load_yaml"]

T = TypeVar("T")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a clear error if the file is missing or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        with path.open() as handle:  # a stream, so a syntax error names the file (not "<unicode string>")
            data = yaml.safe_load(handle) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"config file {str(path)!r} is not valid YAML at{where}: {problem}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must contain a mapping at the top level")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``["engine.optimizer.lr=1e-3", "steps=10"]`` to a nested dict (values parsed as YAML); an override
    replaces the value of the same key given dotted in ``data`` (``rollout.engine: vllm``) too."""
    result = _deep_copy(_expand_dotted(data, "the config"))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value (e.g. engine.optimizer.lr=1e-3)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        node = result
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def build_config(cls: type[T], data: dict[str, Any], *, where: str = "") -> T:
    """Instantiate dataclass ``cls`` from ``data``, recursing into nested dataclasses.

    A dotted key is a nested one (``{"rollout.engine": "vllm"}`` = ``{"rollout": {"engine": "vllm"}}``, as in
    overrides). Unknown keys raise `ValueError` listing the valid ones, and a key the class renamed (its
    ``RENAMED_KEYS``, old -> new) names the new one; values are coerced to the annotated scalar types (int, float,
    bool, str, tuples).
    """
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or cls.__name__!r} must be a mapping, got {data!r}")
    data = _expand_dotted(data, where or cls.__name__)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    renamed: dict[str, str] = getattr(cls, "RENAMED_KEYS", {})
    moved = sorted(k for k in data if k not in fields and k in renamed)
    if moved:
        key = moved[0]
        prefix = f"{where}." if where else ""
        raise ValueError(
            f"config key {prefix}{key} is now {prefix}{renamed[key]}: write it under that section"
            + (f" (also move {[prefix + k for k in moved[1:]]})" if len(moved) > 1 else "")
        )
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown} in {where or cls.__name__}; valid keys: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"missing required config key(s) {missing} in {where or cls.__name__}")
    return cls(**kwargs)


def _expand_dotted(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"a.b": 1, "a": {"c": 2}}`` -> ``{"a": {"b": 1, "c": 2}}``; a key given twice is a `ValueError`."""
    if not any(isinstance(k, str) and "." in k for k in data):
        return data
    out: dict[str, Any] = {}
    for key, value in data.items():
        parts = key.split(".") if isinstance(key, str) else [key]
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"config key {key!r} in {where}: {part!r} is a value, not a section")
            node = child
        last = parts[-1]
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            more = _expand_dotted(value, f"{where}.{key}")
            if twice := sorted(set(node[last]) & set(more)):
                raise ValueError(f"config key(s) {twice} of {key!r} are given twice in {where}")
            node[last] = {**node[last], **more}
            continue
        if last in node:
            raise ValueError(f"config key {key!r} is given twice in {where}")
        node[last] = dict(_expand_dotted(value, f"{where}.{key}")) if isinstance(value, dict) else value
    return out


def config_to_dict(config: Any) -> dict[str, Any]:
    """A YAML-friendly dict of a (nested) config dataclass."""
    out = dataclasses.asdict(config)
    return _plain(out)  # type: ignore[no-any-return]


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise ValueError(f"{where}: {value!r} does not match {hint}: {'; '.join(errors)}")
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(hint):
        return build_config(hint, value, where=where)  # type: ignore[arg-type]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, where) for v in value)
        if len(args) != len(value):
            raise ValueError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, where) for a, v in zip(args, value))
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads "1e-3" (no dot) as a string; accept what float() parses.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def field_docs(cls: type[Any]) -> dict[str, str]:
    """The attribute docstrings (the string literal under each field) of a dataclass and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def describe_config(cls: type[Any], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(dotted key, type, default, docstring)`` for every field of a config dataclass, nested
    sections expanded (``engine.optimizer.lr``); required keys have default ``(required)``."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows: list[tuple[str, str, str, str]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe_config(hint, f"{prefix}{f.name}."))  # type: ignore[arg-type]
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        type_name = getattr(hint, "__name__", None) if isinstance(hint, type) else None
        rows.append((prefix + f.name, type_name or str(hint).replace("typing.", ""), default, docs.get(f.name, "")))
    return rows
