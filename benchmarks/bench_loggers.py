"""Metrics-logger overhead: demo SFT step time with ``loggers: [jsonl, tensorboard, wandb, mlflow]``
(wandb offline, mlflow's default sqlite store in the output dir) vs ``loggers: []``.

The demo's model (Qwen3 3.2M), data and SFT settings (demo_sft.yaml: global batch 64, log every
step), world 1, in this process. A timing sink listed first in both runs records the time of each
step's log call; a step's time is the gap between two consecutive calls, so it includes the other
sinks' work for the previous step. Runs alternate A/B ``ROUNDS`` times; per run the median step
time after ``WARMUP`` steps; the result is the median over rounds and the ratio on/off. Start-up
(tracker run creation) is reported separately. Target: < 2% step-time overhead.

Run: ``python benchmarks/bench_loggers.py`` from the repo root (about a minute); needs
``pip install 'shardforge-algorithms[trackers]'`` for wandb/mlflow (without them they are left out
and said so).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "logger_overhead"
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
STEPS = 14
WARMUP = 3
TIMES: list[float] = []


class _Timer:
    """The first sink of both runs: the time of every train log call."""

    def log(self, step: int, values: dict[str, float], split: str) -> None:
        if split == "train":
            TIMES.append(time.perf_counter())

    def close(self) -> None:
        pass


def timer(out_dir: Path, run_config: dict[str, Any]) -> _Timer:
    return _Timer()


def run_once(assets: dict[str, Any], out: Path, loggers: list[str]) -> tuple[float, float]:
    """(median step seconds after warm-up, seconds from start to the first logged step)."""
    import yaml

    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.demos import demo
    from shardforge.algorithms.trainers import TRAINERS

    data = yaml.safe_load((Path(demo.__file__).parent / "demo_sft.yaml").read_text())
    data |= {
        "model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(out),
        "layout": "d1", "steps": STEPS, "progress": False, "export_hf_at_end": False, "eval_every": 0,
        "loggers": ["bench_loggers:timer", *loggers], "tracker": {"project": "bench"},
    }  # fmt: skip
    spec = TRAINERS.get("sft")
    TIMES.clear()
    started = time.perf_counter()
    spec.run(build_config(spec.config_cls, data))
    gaps = [b - a for a, b in zip(TIMES[WARMUP:], TIMES[WARMUP + 1 :], strict=False)]
    return statistics.median(gaps), TIMES[0] - started


def main() -> int:
    import logging

    import torch

    from shardforge.algorithms.demos.demo import prepare_demo

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.modules.setdefault("bench_loggers", sys.modules[__name__])
    os.environ.setdefault("WANDB_MODE", "offline")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(var, None)
    trackers = [name for name in ("wandb", "mlflow") if importlib.util.find_spec(name) is not None]
    on = sys.argv[1:] or ["jsonl", "tensorboard", *trackers]  # e.g. `bench_loggers.py mlflow` for one sink
    info = _common.machine_info()
    results: dict[str, dict[str, list[float]]] = {"off": {"step": [], "startup": []}, "on": {"step": [], "startup": []}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("WANDB_CONFIG_DIR", str(root / "wandb-config"))
        os.environ.setdefault("WANDB_CACHE_DIR", str(root / "wandb-cache"))
        assets = prepare_demo(root / "assets", num_eval=10)
        for round_ in range(ROUNDS):
            for label, loggers in (("off", []), ("on", on)) if round_ % 2 == 0 else (("on", on), ("off", [])):
                step, startup = run_once(assets, root / f"{label}{round_}", loggers)
                results[label]["step"].append(step)
                results[label]["startup"].append(startup)
                print(f"round {round_} {label}: step {step * 1000:.1f} ms, start-up {startup:.2f} s", flush=True)
    medians = {label: {k: statistics.median(v) for k, v in r.items()} for label, r in results.items()}
    ratio = medians["on"]["step"] / medians["off"]["step"]
    per_round = [a / b for a, b in zip(results["on"]["step"], results["off"]["step"], strict=True)]
    payload = {
        "machine": info, "loggers_on": on, "steps": STEPS, "warmup": WARMUP, "results": results,
        "median": medians, "ratio": ratio, "ratio_per_round": per_round,
    }  # fmt: skip
    path = _common.write_json(NAME, payload)
    print(json.dumps(payload, indent=2))
    print(f"step time with {on} / with none: {ratio:.4f} (rounds {', '.join(f'{r:.3f}' for r in per_round)})")
    _common.upsert_result_row(
        benchmark=NAME,
        metric=f"demo SFT step time, loggers [{', '.join(on)}] / none (median of {ROUNDS} alternated runs)",
        ours=f"{medians['on']['step'] * 1000:.1f} ms",
        baseline=f"{medians['off']['step'] * 1000:.1f} ms",
        ratio=f"{ratio:.3f}",
        target=f"< 1.02 ({'met' if ratio < 1.02 else 'missed'})",
        machine=_common.machine_label(info),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
