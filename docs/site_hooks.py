"""MkDocs hooks for the docs site (`nox -s docs`, mkdocs.yml).

The markdown under docs/ is written to be read on the repository too, so it links to files outside docs/
(``../benchmarks/bench_x.py``, ``../examples/sft_tiny.yaml``) and README.md links into ``docs/``. A site has
neither, and strict mode fails on links it cannot resolve. These hooks:

- add the site's home page, generated from README.md with its ``docs/...`` links made site-relative;
- turn a link to an existing repository file outside docs/ into the file's repository path in code
  (``bench_x.py`` -> `benchmarks/bench_x.py`), or into a link under ``repo_url`` when mkdocs.yml sets one;
- report a link to a missing repository file as a warning, which ``mkdocs build --strict`` turns into a failure.

Links between pages inside docs/ are left to MkDocs' own validation (strict: a broken one fails).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.shardforge")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# [text](target) where target has no scheme; images too (the leading ! stays outside the match).
LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")


def on_files(files: Files, config: Any) -> Files:
    """Add index.md (the home page) made from README.md, its links made relative to docs/."""
    readme = (ROOT / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=_readme_for_site(readme)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite links that leave docs/ (see the module docstring)."""
    source = page.file.src_uri
    where = (DOCS / source).parent
    repo_url = (config.get("repo_url") or "").rstrip("/")
    return LINK.sub(lambda match: _rewrite(match, where, source, repo_url), markdown)


def _readme_for_site(readme: str) -> str:
    def site_relative(match: re.Match[str]) -> str:
        target = match.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return match.group(0)
        if target.startswith("docs/"):
            return f"[{match.group('text')}]({target.removeprefix('docs/')})"
        return f"[{match.group('text')}](../{target})"  # a repository file: relative to docs/ now

    return LINK.sub(site_relative, readme)


def _rewrite(match: re.Match[str], where: Path, source: str, repo_url: str) -> str:
    text, target = match.group("text"), match.group("target")
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return match.group(0)
    path_part, _, anchor = target.partition("#")
    resolved = (where / path_part).resolve()
    try:
        resolved.relative_to(DOCS)
        return match.group(0)  # a page or asset of the site: MkDocs validates it
    except ValueError:
        pass
    try:
        relative = resolved.relative_to(ROOT).as_posix()
    except ValueError:
        log.warning(f"{source}: link {target!r} points outside the repository")
        return text
    if not resolved.exists():
        log.warning(f"{source}: link {target!r} names {relative}, which does not exist")
        return text
    if repo_url:
        kind = "tree" if resolved.is_dir() else "blob"
        return f"[{text}]({repo_url}/{kind}/main/{relative}{'#' + anchor if anchor else ''})"
    if text.strip("`") == relative or text.strip("`") == resolved.name:
        return f"`{relative}`"
    return f"{text} (`{relative}`)"
