"""GRPO step time, synchronous vs asynchronous rollouts (``async_rollouts``, ``max_staleness=1``).

``shardforge train grpo`` under ``torchrun`` with the demo's GRPO settings (``demo_grpo.yaml``:
64 prompts x 8 samples, 6 new tokens, T=0.7) on the demo model (3.16M-parameter Qwen3, random
weights: timing does not need a trained policy), ``WARMUP + TIMED`` steps per run, one intra-op
thread per rank (``OMP_NUM_THREADS=1``; the generator thread of a rank gets one as well). Two
settings:

- **2 ranks** (FSDP ``d2``): two ranks on this 2-core machine already use both cores in the
  synchronous mode, so the background generator competes with training for the same cores;
- **1 rank** (``d1``): one core is idle in the synchronous mode; the generator can use it.

The step time is the gap between two consecutive metric records of rank 0 (the first
``WARMUP`` steps are dropped). Runs alternate sync / async (ABAB) so load from other processes
on a shared machine hits both alike; the load average is recorded.

Run: ``python benchmarks/bench_grpo_async.py`` from the repo root (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "grpo_async"
WARMUP, TIMED = 2, 10
REPEATS = 2  # ABAB
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
MODES = {"sync": ["async_rollouts=false"], "async": ["async_rollouts=true", "max_staleness=1"]}
SETTINGS = {"2 ranks (d2)": (2, "d2"), "1 rank (d1)": (1, "d1")}
KEYS = ("generate_s", "rollout_wait_s", "logprob_forward_s", "train_s", "weight_sync_s")


def load_average() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def run(assets: dict[str, Any], out_dir: Path, world: int, layout: str, mode: str) -> dict[str, Any]:
    import shardforge.algorithms as algorithms

    config = Path(algorithms.__file__).parent / "demos" / "demo_grpo.yaml"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config),
        f"model={assets['model']}", f"train_file={assets['train']}", f"output_dir={out_dir}",
        f"layout={layout}", f"steps={WARMUP + TIMED}", "resume=never", "export_hf_at_end=false", "progress=false",
        *MODES[mode],
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, **ENV}, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("split", "train") == "train"]
    steps = [
        {"wall_s": rec["time"] - prev["time"], **{k: rec.get(k, 0.0) for k in KEYS}}
        for prev, rec in itertools.pairwise(train)
        if rec["step"] > WARMUP
    ]
    if len(steps) != TIMED:
        raise RuntimeError(f"expected {TIMED} timed steps in {out_dir}/metrics.jsonl, found {len(steps)}")
    return {k: sum(s[k] for s in steps) / len(steps) for k in ("wall_s", *KEYS)}


def main() -> int:
    from shardforge.algorithms.demos.demo import prepare_demo

    started = time.perf_counter()
    info = _common.machine_info()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_grpo_async_") as tmp:
        work = Path(tmp)
        assets = prepare_demo(work / "demo")
        for label, (world, layout) in SETTINGS.items():
            runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
            loads = []
            for repeat, mode in itertools.product(range(REPEATS), MODES):
                loads.append(load_average())
                runs[mode].append(run(assets, work / f"{layout}_{mode}_{repeat}", world, layout, mode))
                print(f"[{NAME}] {label} {mode} #{repeat}: {runs[mode][-1]['wall_s']:.2f} s/step", flush=True)
            mean = {m: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for m, rs in runs.items()}
            speedup = mean["sync"]["wall_s"] / mean["async"]["wall_s"]
            results[label] = {"runs": runs, "mean": mean, "speedup": speedup, "load_average": loads}
            print(f"[{NAME}] {label}: async speedup {speedup:.2f}x", flush=True)
    payload = {
        "machine": info,
        "settings": {"warmup_steps": WARMUP, "timed_steps": TIMED, "repeats": REPEATS, "config": "demo_grpo.yaml"},
        "results": results,
        "seconds": time.perf_counter() - started,
    }
    path = _common.write_json(NAME, payload)
    print(f"[{NAME}] wrote {path}")
    for label, result in results.items():
        sync, asy = result["mean"]["sync"], result["mean"]["async"]
        _common.upsert_result_row(
            benchmark=f"{NAME} {label.split()[0]}r",
            metric=f"GRPO s/step, {label}, demo settings",
            ours=f"async (staleness 1) {asy['wall_s']:.2f} s",
            baseline=f"sync {sync['wall_s']:.2f} s",
            ratio=f"{result['speedup']:.2f}x",
            target="report",
            machine=_common.machine_label(info),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
