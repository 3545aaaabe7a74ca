"""Run the shell blocks of README.md and docs/*.md that are marked runnable, as written.

A block is marked by an HTML comment on the line before its fence:

    <!-- runnable: steps=2 eval_every=0 -->
    ```bash
    shardforge demo --prepare-only
    shardforge train sft --config examples/sft_tiny.yaml --nproc-per-node 2
    ```

Each block runs with ``bash -euo pipefail`` in a fresh copy of the repository (tracked files only)
in a temporary directory, blocks of one file in order and in the same copy (a later block may use
what an earlier one made). The ``key=value`` words after ``runnable:`` are appended to every
``shardforge train`` line so the check uses tiny step counts; nothing else is changed. ``nox -s
docs`` runs this in its own virtualenv, so the blocks' ``pip install`` lines run there.

    python docs/run_docs.py [README.md docs/quickstart.md ...]
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<overrides>[^>]*?))?\s*-->\s*$")
FENCE = re.compile(r"^```(?:bash|sh|shell)\s*$")


def runnable_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """``(line number of the fence, script, overrides)`` for every marked bash block."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match or i + 1 >= len(lines) or not FENCE.match(lines[i + 1].strip()):
            continue
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        overrides = (match.group("overrides") or "").split()
        blocks.append((i + 2, "\n".join(lines[i + 2 : end]), overrides))
    return blocks


def with_overrides(script: str, overrides: list[str]) -> str:
    """Append ``overrides`` to each ``shardforge train`` command (before a trailing comment)."""
    if not overrides:
        return script
    out = []
    for line in script.splitlines():
        if line.lstrip().startswith("shardforge train "):
            command, hash_, comment = line.partition("  #")
            line = f"{command.rstrip()} {' '.join(overrides)}" + (f"  {hash_.strip()}{comment}" if hash_ else "")
        out.append(line)
    return "\n".join(out)


def _copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in files.splitlines():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, target)


def main(paths: list[str]) -> int:
    files = [Path(p) for p in paths] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    failures = 0
    for path in files:
        blocks = runnable_blocks(path.read_text())
        if not blocks:
            continue
        with tempfile.TemporaryDirectory(prefix="shardforge-docs-") as tmp:
            _copy_repo(Path(tmp))
            for line, script, overrides in blocks:
                started = time.time()
                script = with_overrides(script, overrides)
                result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp)
                status = "ok" if result.returncode == 0 else f"FAILED (exit {result.returncode})"
                print(f"{path.name}:{line}: {status} in {time.time() - started:.0f}s", flush=True)
                failures += result.returncode != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
