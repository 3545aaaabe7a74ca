"""``metrics.jsonl``: one ``{"step", "split", "time", **values}`` object per line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["JsonlLogger", "read_metrics", "truncate_metrics"]


class JsonlLogger:
    """Append records to ``path`` (created with its parent directory)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, values: dict[str, float], split: str) -> None:
        record = {"step": step, "split": split, "time": time.time(), **values}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


def read_metrics(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """The records of one split from a ``metrics.jsonl``."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("split") == split:
                records.append(record)
    return records


def truncate_metrics(path: str | Path, step: int) -> int | None:
    """Drop records past ``step``: after a resume from ``step`` they belong to the interrupted run
    (a fresh start, step 0, begins a new file). Return the last step the file had recorded (None: no
    records), so the trackers know whether the interrupted run logged steps they must drop too."""
    path = Path(path)
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    steps = [int(json.loads(line)["step"]) for line in lines]
    path.write_text("".join(line + "\n" for line, s in zip(lines, steps) if s <= step))
    return max(steps, default=None)
