"""Check the markdown docs: every relative link and every backticked repo path must exist.

Run by `nox -s docs`. Exits non-zero listing the broken references.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATHLIKE = re.compile(r"`((?:packages|docs|examples|benchmarks|integration_tests)/[^`\s]*)`")


def check(md: Path) -> list[str]:
    problems = []
    text = md.read_text()
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = (md.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            problems.append(f"{md.relative_to(ROOT)}: broken link {target}")
    for target in PATHLIKE.findall(text):
        if any(ch in target for ch in "*{}<>"):
            continue
        if not (ROOT / target).exists():
            problems.append(f"{md.relative_to(ROOT)}: referenced path {target} does not exist")
    return problems


def main() -> int:
    files = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "packages").glob("*/README.md")),
    ]
    problems = [p for md in files for p in check(md)]
    for problem in problems:
        print(problem)
    print(f"checked {len(files)} markdown files: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
