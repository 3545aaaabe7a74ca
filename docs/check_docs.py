"""Check the markdown docs: every relative link and every backticked repo path must exist.

``path/to/test_file.py::test_name`` must name a file that defines ``test_name``. Paths under
``benchmarks/out/`` are outputs the benchmarks write (git-ignored), so a clean clone has none of
them: they are not checked.

Run by `nox -s docs`. Exits non-zero listing the broken references.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
GENERATED = ("benchmarks/out/",)
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
        if any(ch in target for ch in "*{}<>") or target.startswith(GENERATED):
            continue
        path, _, test = target.partition("::")
        if not (ROOT / path).exists():
            problems.append(f"{md.relative_to(ROOT)}: referenced path {path} does not exist")
        elif test and not re.search(rf"def {re.escape(test.split('[')[0])}\(", (ROOT / path).read_text()):
            problems.append(f"{md.relative_to(ROOT)}: {path} defines no {test.split('[')[0]}")
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
