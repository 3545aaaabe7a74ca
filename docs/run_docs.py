"""Run the shell blocks of README.md and docs/*.md that are marked runnable, as written.

A block is marked by an HTML comment on the line before its fence (a ``python`` block runs as a script,
under ``torchrun --nproc-per-node N`` when the comment says ``torchrun=N``):

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
FENCE = re.compile(r"^```(?P<language>bash|sh|shell|python)\s*$")


def runnable_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """``(line number of the fence, bash script, overrides)`` for every marked bash or python block. A python
    block becomes a script that writes it to a file and runs it, under ``torchrun`` with N ranks when its
    marker says ``torchrun=N``."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        fence = FENCE.match(lines[i + 1].strip()) if match and i + 1 < len(lines) else None
        if not match or not fence:
            continue
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        words = (match.group("overrides") or "").split()
        ranks = next((int(w.split("=", 1)[1]) for w in words if w.startswith("torchrun=")), 0)
        overrides = [w for w in words if not w.startswith("torchrun=")]
        script = "\n".join(lines[i + 2 : end])
        if fence.group("language") == "python":
            name = f"docs_block_{i + 2}.py"
            runner = f"torchrun --standalone --nproc-per-node {ranks}" if ranks else "python"
            script = f"cat > {name} <<'PYTHON_BLOCK'\n{script}\nPYTHON_BLOCK\n{runner} {name}"
        blocks.append((i + 2, script, overrides))
    return blocks


def with_overrides(script: str, overrides: list[str]) -> str:
    """Append ``overrides`` to each ``shardforge train`` command (before a trailing comment and a trailing
    ``&``; on the last line of a command continued with ``\\``)."""
    if not overrides:
        return script
    out = []
    in_train = False
    for line in script.splitlines():
        in_train = in_train or line.lstrip().startswith("shardforge train ")
        if in_train and not line.rstrip().endswith("\\"):
            command, hash_, comment = line.partition("  #")
            command = command.rstrip()
            background = command.endswith("&")
            command = command.removesuffix("&").rstrip()
            line = f"{command} {' '.join(overrides)}" + (" &" if background else "")
            line += f"  {hash_.strip()}{comment}" if hash_ else ""
            in_train = False
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
