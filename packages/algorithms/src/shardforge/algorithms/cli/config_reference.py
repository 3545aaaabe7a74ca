"""docs/configuration.md, generated from the config dataclasses: every key of every trainer (and of
``shardforge eval``), its type, default and docstring. ``shardforge config-reference`` writes it and, with
``--check``, fails when the committed page is stale or a field has no docstring (a test runs that check).

Layout: one section per command listing its own top-level keys; every nested section (``engine``, ``rollout``,
``rollout.vllm``, ``workflow``, ``reward``, ...) is documented once under "Sections", alphabetically, with the dotted
keys where it sits, and linked from each key that holds it, so a key is looked up in one place whichever trainer uses
it. Docstrings are the string literal under each field (``config_io.field_docs``, which walks the MRO so an inherited
field is documented by the class that declares it).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from shardforge.algorithms.config_io import field_docs

__all__ = ["check_reference", "commands", "render_reference", "section_paths", "undocumented_fields"]

HEADER = """# Configuration reference

Every key of every `shardforge train <name>` config and of `shardforge eval`: its type, default and meaning. YAML
keys are these names; nested sections are mappings (`rollout: {engine: vllm}`), written dotted in overrides
(`rollout.engine=vllm`) or in YAML (`rollout.engine: vllm`); a `list of` section is a YAML list of mappings
(`rewards: [{name: exact_match, weight: 1.0}]`). Required keys have no default.

This page is generated from the config dataclasses (their field docstrings): do not edit it by hand. After changing a
config, run `shardforge config-reference` from the repository root (the tests fail while it is stale or a field has
no docstring; `shardforge config-reference --check` says which).
"""


def commands() -> dict[str, type[Any]]:
    """``{"train <name>": config class}`` for every registered trainer (sorted), and ``{"eval": EvalConfig}``."""
    from shardforge.algorithms.trainers import TRAINERS
    from shardforge.algorithms.trainers.eval_run import EvalConfig

    out: dict[str, type[Any]] = {f"train {name}": TRAINERS.get(name).config_cls for name in sorted(TRAINERS.names())}
    return out | {"eval": EvalConfig}


def _descriptions() -> dict[str, str]:
    """A one-line description of each command (the trainer registry's), for its section's intro."""
    from shardforge.algorithms.trainers import TRAINERS

    out = {f"train {name}": text for name, text in TRAINERS.describe()}
    return out | {"eval": "evaluate a model on held-out prompts (greedy accuracy, avg@n, pass@k)"}


def _section_type(hint: Any) -> type[Any] | None:
    """The dataclass a field holds (directly, or as the items of a tuple / an optional), else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _anchor(cls: type[Any]) -> str:
    """The GitHub anchor of the section's heading (``### Name``)."""
    return cls.__name__.lower()


def _type_name(hint: Any) -> str:
    """A readable type: Literal values listed, ``X \\| null``, tuples as lists, dataclasses as links."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"[{hint.__name__}](#{_anchor(hint)})"
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return f"[{', '.join(_type_name(a) for a in args)}]" if args else "list"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}" if args else "mapping"
    if hint is type(None):
        return "null"
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def _plain(value: Any) -> Any:
    """A value as YAML would hold it: tuples as lists, dataclasses as mappings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _yaml(value: Any) -> str:
    """One value as inline YAML (``null``, ``true``, ``[jsonl, tensorboard]``, ``1.0e-05``)."""
    try:
        text = yaml.safe_dump(_plain(value), default_flow_style=True, width=math.inf, sort_keys=False)
    except yaml.YAMLError:
        return str(value)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _code(text: str) -> str:
    """``text`` as a code span in a table cell (the cell separator escaped)."""
    return f"`{text}`".replace("|", "\\|")


def _overrides(value: Any, base: Any, prefix: str = "") -> list[str]:
    """``key: value`` for every field where the dataclass ``value`` differs from ``base`` (nested sections dotted)."""
    out: list[str] = []
    for f in dataclasses.fields(value):
        mine, theirs = getattr(value, f.name), getattr(base, f.name)
        if mine == theirs:
            continue
        if dataclasses.is_dataclass(mine) and type(mine) is type(theirs):
            out += _overrides(mine, theirs, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}: {_yaml(mine)}")
    return out


def _default(field: dataclasses.Field[Any], section: type[Any] | None) -> str:
    """The default as YAML; a section held by default links to its own defaults, naming any this key changes."""
    if field.default is not dataclasses.MISSING:
        return _code(_yaml(field.default))
    if field.default_factory is dataclasses.MISSING:
        return "**required**"
    value = field.default_factory()
    if section is None or not isinstance(value, section):
        return _code(_yaml(value))
    try:
        changed = _overrides(value, section())
    except TypeError:  # the section has required keys: its defaults are not one value
        changed = []
    return "(section)" + (", with " + ", ".join(_code(c) for c in changed) if changed else "")


def _doc(text: str) -> str:
    """A docstring as one table-cell line."""
    return " ".join(text.split()).replace("|", "\\|")


def _rows(cls: type[Any]) -> list[str]:
    """The markdown table of ``cls``'s fields: key, type, default, docstring."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        doc = _doc(docs.get(field.name, ""))
        rows.append(f"| `{field.name}` | {_type_name(hint)} | {_default(field, _section_type(hint))} | {doc} |")
    return rows


def section_paths() -> dict[type[Any], list[str]]:
    """Every nested section reachable from a command, with the dotted keys where it sits (``rewards[]`` for the
    items of a list of sections), sorted."""
    paths: dict[type[Any], set[str]] = {}

    def walk(cls: type[Any], prefix: str, chain: tuple[type[Any], ...]) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            hint = hints[field.name]
            section = _section_type(hint)
            if section is None or section in chain:
                continue
            key = prefix + field.name + ("[]" if typing.get_origin(hint) is tuple else "")
            paths.setdefault(section, set()).add(key)
            walk(section, key + ".", (*chain, section))

    for cls in commands().values():
        walk(cls, "", (cls,))
    return {section: sorted(keys) for section, keys in paths.items()}


def _class_doc(cls: type[Any]) -> str:
    """The class docstring, or "" where only dataclass's generated signature stands in for one."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else _doc(doc)


def render_reference() -> str:
    """The whole page (deterministic: commands sorted, then every section once, alphabetically)."""
    parts = [HEADER]
    descriptions = _descriptions()
    for command, cls in commands().items():
        doc = descriptions.get(command, "")
        intro = (f"{doc[:1].upper()}{doc[1:]}. " if doc else "") + f"Config class `{cls.__module__}.{cls.__name__}`."
        parts += [f"## `shardforge {command}`", "", intro, "", *_rows(cls), ""]
    parts += ["## Sections", "", "Each nested section once, alphabetically; the keys above link here.", ""]
    for section, keys in sorted(section_paths().items(), key=lambda item: (item[0].__name__, item[0].__module__)):
        where = ", ".join(f"`{key}`" for key in keys)
        doc = _class_doc(section)
        parts += [f"### {section.__name__}", "", f"Keys: {where} (`{section.__module__}.{section.__name__}`).", ""]
        parts += [doc, ""] if doc else []
        parts += [*_rows(section), ""]
    return "\n".join(parts).rstrip() + "\n"


def undocumented_fields() -> list[str]:
    """``Class.field`` of every config field (commands and their sections) without a docstring, sorted."""
    missing: list[str] = []
    for cls in [*commands().values(), *section_paths()]:
        docs = field_docs(cls)
        missing += [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]
    return sorted(set(missing))


def check_reference(path: str | Path) -> list[str]:
    """What is wrong with the page at ``path``: undocumented fields, or a page that differs from the generated one."""
    problems = [f"config field {name} has no docstring" for name in undocumented_fields()]
    page = Path(path)
    if not page.is_file():
        problems.append(f"{page} does not exist: run `shardforge config-reference --out {page}`")
    elif page.read_text() != render_reference():
        problems.append(f"{page} is stale: run `shardforge config-reference --out {page}`")
    return problems
