"""Single-process thread count: SFT tokens/s at 1 and 2 torch threads, on a quiet machine and with
other processes keeping the cores busy (as on a shared 2-core CI box).

The demo Qwen3 (bench_sft_throughput's 3.2M-weight config and batches) trains in a fresh
process per (threads, load) cell; ``LOAD`` busy-loop processes stand for other jobs. Cells run
alternately, ``ROUNDS`` times. This is the measurement behind the CLI's default thread count
(`shardforge.algorithms.trainers.run.threads.default_threads`, docs/packages/algorithms.md "Threads").

Run: ``python benchmarks/bench_threads.py`` from the repo root (a few minutes).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "single_process_threads"
ROUNDS = 2
LOADS = (0, 2)
THREADS = (1, 2)

CHILD = r"""
import sys, time, json, torch
sys.path.insert(0, {bench!r})
import bench_sft_throughput as sft
from transformers import Qwen3Config
from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences
torch.set_num_threads({threads})
batches, _ = sft.make_batches()
engine = TrainEngine(Qwen3Config(**sft.MODEL), "d1", EngineConfig(
    optimizer=OptimizerConfig(lr=sft.LR, max_grad_norm=sft.MAX_GRAD_NORM), seed=sft.SEED))
tokens, start = 0.0, None
for i, batch in enumerate(batches[: sft.WARMUP + 4]):
    if i == sft.WARMUP:
        start = time.perf_counter()
    stats = engine.train_batch(pack_sequences([ids for ids, _ in batch], [m for _, m in batch]))
    if start is not None:
        tokens += stats["tokens"]
print(json.dumps({{"tokens_per_s": tokens / (time.perf_counter() - start)}}))
"""


def cell(threads: int, load: int) -> float:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        code = CHILD.format(bench=str(Path(__file__).resolve().parent), threads=threads)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        return float(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def main() -> int:
    started = time.perf_counter()
    info = _common.machine_info()
    results: dict[str, list[float]] = {f"load{ld}_threads{t}": [] for ld in LOADS for t in THREADS}
    for _ in range(ROUNDS):
        for load in LOADS:
            for threads in THREADS:
                results[f"load{load}_threads{threads}"].append(cell(threads, load))
    medians = {k: statistics.median(v) for k, v in results.items()}
    payload = {"machine": info, "tokens_per_s": results, "median": medians, "seconds": time.perf_counter() - started}
    path = _common.write_json(NAME, payload)
    print(json.dumps(payload, indent=2))
    loaded = medians[f"load{LOADS[-1]}_threads1"] / medians[f"load{LOADS[-1]}_threads2"]
    quiet = medians["load0_threads1"] / medians["load0_threads2"]
    _common.upsert_result_row(
        benchmark=NAME,
        metric=f"SFT tokens/s, 1 process: 1 thread / 2 threads (quiet; {LOADS[-1]} busy processes)",
        ours=f"1 thread: {medians['load0_threads1']:.0f}; {medians[f'load{LOADS[-1]}_threads1']:.0f}",
        baseline=f"2 threads: {medians['load0_threads2']:.0f}; {medians[f'load{LOADS[-1]}_threads2']:.0f}",
        ratio=f"{quiet:.2f}; {loaded:.2f}",
        target="informs the default (no target)",
        machine=_common.machine_label(info),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
