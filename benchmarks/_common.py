"""Shared helpers for the benchmark scripts: machine info, JSON output, RESULTS.md rows, plots.

Every ``benchmarks/bench_*.py`` writes ``benchmarks/out/<name>.json`` and ``<name>.png``
(git-ignored) and upserts one row per benchmark name in ``benchmarks/RESULTS.md`` (committed).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
OUT_DIR = BENCH_DIR / "out"
RESULTS_MD = BENCH_DIR / "RESULTS.md"

RESULTS_HEADER = """# Benchmark results

One row per benchmark, replaced each time its script runs (see [docs/benchmarks.md](../docs/benchmarks.md)).
`ratio` is ours / baseline; `target` says which way is better and whether this run met it.

| benchmark | metric | ours | baseline | ratio | target | machine (cpu model, cores) | date |
|---|---|---|---|---|---|---|---|
"""


def cpu_model() -> str:
    """The CPU model name (from /proc/cpuinfo on Linux, else `platform`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def usable_cores() -> int:
    """Cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "cpu_model": cpu_model(),
        "cores": usable_cores(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def machine_label(info: dict[str, Any] | None = None) -> str:
    info = info or machine_info()
    return f"{info['cpu_model']}, {info['cores']} cores"


def today() -> str:
    return datetime.date.today().isoformat()


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``benchmarks/out/<name>.json`` and return its path."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def png_path(name: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR / f"{name}.png"


def pyplot() -> Any:
    """matplotlib.pyplot with the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def upsert_result_row(
    *,
    benchmark: str,
    metric: str,
    ours: str,
    baseline: str,
    ratio: str,
    target: str,
    machine: str,
    date: str | None = None,
    path: Path = RESULTS_MD,
) -> None:
    """Append a row to RESULTS.md, or replace the row whose first cell is ``benchmark``.

    Creates the file with its header when missing.
    """
    row = (
        "| "
        + " | ".join(_cell(v) for v in (benchmark, metric, ours, baseline, ratio, target, machine, date or today()))
        + " |"
    )
    text = path.read_text() if path.exists() else RESULTS_HEADER
    lines = text.rstrip("\n").split("\n")
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and cells[0] == benchmark:
            lines[i] = row
            break
    else:
        lines.append(row)
    path.write_text("\n".join(lines) + "\n")


def target_cell(target: str, met: bool) -> str:
    return f"{target} ({'met' if met else 'MISSED'})"
