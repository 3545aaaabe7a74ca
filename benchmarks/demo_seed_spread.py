"""The SFT demo's spread over training seeds: how docs/demos.md's table was measured (not a `bench_*` script:
each run is a whole demo, ~5 minutes on 2 cores, so `nox -s benchmarks` does not run it).

    python benchmarks/demo_seed_spread.py [--seeds 0 1 2 3 4] [--steps 1000] [--out outputs/demo_spread] [override ...]

For each seed: the demo's own torchrun SFT command (`demos/demo_sft.yaml`, FSDP on 2 ranks) on the demo's model
and data (built once, seed 0, so every run has the same initial weights and held-out pairs) with ``seed=S`` (the
data order) and any ``key=value`` overrides, then greedy held-out exact match. One JSON line per run is appended
to ``<out>/results.jsonl`` and printed; the mean and sample standard deviation are printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from shardforge.algorithms.demos.demo import held_out_accuracy, prepare_demo


def run(out: Path, seed: int, steps: int, overrides: list[str]) -> dict[str, object]:
    import shardforge.algorithms.demos as demos

    assets = out / "assets"
    if not (assets / "data" / "eval.jsonl").exists():
        prepare_demo(assets, seed=0)
    run_dir = out / f"seed{seed}"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "shardforge.algorithms.cli", "train", "sft", "--config", str(Path(demos.__file__).with_name("demo_sft.yaml")),
        f"model={assets / 'model'}", f"train_file={assets / 'data' / 'train.jsonl'}",
        f"eval_file={assets / 'data' / 'eval.jsonl'}", f"output_dir={run_dir}", f"steps={steps}", "layout=d2",
        f"engine.scheduler.total_steps={steps}", f"seed={seed}", "resume=never", *overrides,
    ]  # fmt: skip
    started = time.time()
    subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return {
        "seed": seed, "steps": steps, "overrides": overrides, "minutes": round((time.time() - started) / 60, 2),
        "accuracy": held_out_accuracy(run_dir / "hf", assets / "data" / "eval.jsonl"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", default="outputs/demo_spread")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of demo_sft.yaml")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    accuracies = []
    for seed in args.seeds:
        record = run(out, seed, args.steps, args.overrides)
        accuracies.append(float(record["accuracy"]))  # type: ignore[arg-type]
        with (out / "results.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    if len(accuracies) > 1:
        print(f"mean {statistics.mean(accuracies):.1%}, sample std {statistics.stdev(accuracies) * 100:.1f} points")


if __name__ == "__main__":
    main()
