"""docs/configuration.md, generated from the config dataclasses: every key of every trainer (and of
``shardforge eval``), its type, default and docstring. ``shardforge config-reference`` writes it and, with
``--check``, fails when the committed page is stale or a field has no docstring (a test runs that check).

Layout: one section per command listing its own top-level keys; every nested section (``engine``, ``rollout``,
``rollout.vllm``, ``workflow``, ``reward``, ...) is documented once under "Sections" and linked from each key that
holds it, so a key is looked up in one place whichever trainer uses it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from shardforge.algorithms.config_io import field_docs

__all__ = ["check_reference", "commands", "render_reference", "undocumented_fields"]

HEADER = """# Configuration reference

Every key of every `shardforge train <name>` config and of `shardforge eval`: its type, default and meaning. YAML
keys are these names; nested sections are mappings (`rollout: {engine: vllm}`), written dotted in overrides
(`rollout.engine=vllm`) or in YAML (`rollout.engine: vllm`). Required keys have no default.

This page is generated from the config dataclasses (their field docstrings): do not edit it by hand. After changing a
config, run `shardforge config-reference` (the tests fail while it is stale or a field has no docstring).
"""


def commands() -> dict[str, type[Any]]:
    """``{"train <name>": config class}`` for every registered trainer, and ``{"eval": EvalConfig}``."""
    from shardforge.algorithms.trainers import TRAINERS
    from shardforge.algorithms.trainers.eval_run import EvalConfig

    out: dict[str, type[Any]] = {f"train {name}": TRAINERS.get(name).config_cls for name in TRAINERS.names()}
    return out | {"eval": EvalConfig}


def _section_type(hint: Any) -> type[Any] | None:
    """The dataclass a field holds (directly, or as the items of a tuple / an optional), else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is tuple:
        return f"list of {_type_name(args[0])}" if len(args) == 2 and args[1] is Ellipsis else "list"
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def _default(field: dataclasses.Field[Any], section: type[Any] | None) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        if section is not None:
            return "(section)"
        value = field.default_factory()
    else:
        return "**required**"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return f"`{list(value)}`"
    return f"`{value}`"


def _anchor(cls: type[Any]) -> str:
    return cls.__name__.lower()


def _rows(cls: type[Any], sections: dict[type[Any], str]) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        section = _section_type(hint)
        kind = f"[{section.__name__}](#{_anchor(section)})" if section is not None else _type_name(hint)
        if section is not None and typing.get_origin(hint) is tuple:
            kind = f"list of {kind}"
        doc = " ".join(docs.get(field.name, "").split()).replace("|", "\\|")
        rows.append(f"| `{field.name}` | {kind} | {_default(field, section)} | {doc} |")
        if section is not None and section not in sections:
            sections[section] = field.name
    return rows


def render_reference() -> str:
    """The whole page (deterministic: commands and sections in a fixed order)."""
    sections: dict[type[Any], str] = {}
    parts = [HEADER]
    for command, cls in commands().items():
        parts += [f"## `shardforge {command}`", "", f"`{cls.__module__}.{cls.__name__}`", "", *_rows(cls, sections), ""]
    parts += ["## Sections", "", "Each nested section once; the keys above link here.", ""]
    done: set[type[Any]] = set()
    while len(done) < len(sections):
        for section in sorted(set(sections) - done, key=lambda c: c.__name__):
            done.add(section)
            doc = " ".join((section.__doc__ or "").split())
            parts += [f"### {section.__name__}", "", f"`{section.__module__}.{section.__name__}`: {doc}", ""]
            parts += [*_rows(section, sections), ""]
    return "\n".join(parts).rstrip() + "\n"


def undocumented_fields() -> list[str]:
    """``Class.field`` of every config field (commands and their sections) without a docstring."""
    missing: list[str] = []
    seen: set[type[Any]] = set()
    todo = list(commands().values())
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not docs.get(field.name, "").strip():
                missing.append(f"{cls.__name__}.{field.name}")
            section = _section_type(hints[field.name])
            if section is not None:
                todo.append(section)
    return sorted(missing)


def check_reference(path: str | Path) -> list[str]:
    """What is wrong with the page at ``path``: undocumented fields, or a page that differs from the generated one."""
    problems = [f"config field {name} has no docstring" for name in undocumented_fields()]
    page = Path(path)
    if not page.is_file():
        problems.append(f"{page} does not exist: run `shardforge config-reference --out {page}`")
    elif page.read_text() != render_reference():
        problems.append(f"{page} is stale: run `shardforge config-reference --out {page}`")
    return problems
