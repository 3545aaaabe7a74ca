"""Replicate-only data parallelism: DDP (`r2`, engine.data_parallel=ddp) vs FSDP (`d2`) on 2 ranks.

Same Qwen3 (the SFT-throughput benchmark's 3.2M-weight config), same initial weights, same
global batches in the same order, same AdamW and clipping; two rank pools of 2 (one per mode,
one thread per rank), run alternately round by round so both see the same machine load. Reports
real tokens/s of each mode, the per-round ratios, and the largest gap between the two modes'
losses (they train the same model on the same data, so the curves must agree: this compares
speed, not different work).

Run: ``python benchmarks/bench_ddp.py`` from the repo root (a couple of minutes).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import bench_sft_throughput as sft

NAME = "ddp_vs_fsdp"
WORLD = 2
ROUNDS = 4
STEPS_PER_ROUND = 2


def setup(data_parallel: str) -> str:
    """On each rank: build the engine for ``data_parallel`` ("ddp" on r2, "fsdp" on d2)."""
    import torch
    from transformers import Qwen3Config

    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    torch.set_num_threads(1)
    layout = f"r{WORLD}" if data_parallel == "ddp" else f"d{WORLD}"
    config = EngineConfig(
        optimizer=OptimizerConfig(lr=sft.LR, max_grad_norm=sft.MAX_GRAD_NORM),
        seed=sft.SEED,
        data_parallel=data_parallel,
    )
    sft._worker_state()["engine"] = TrainEngine(Qwen3Config(**sft.MODEL), layout, config)
    return layout


def main() -> int:
    from shardforge.mesh.testing.pool import RankPool

    started = time.perf_counter()
    info = _common.machine_info()
    batches, _ = sft.make_batches()
    pools = {mode: RankPool(WORLD) for mode in ("ddp", "fsdp")}
    for mode, pool in pools.items():
        pool.run(setup, mode, timeout_s=600)
        pool.run(sft.ours_steps, batches[: sft.WARMUP], timeout_s=600)
    parts: dict[str, list[dict[str, Any]]] = {"ddp": [], "fsdp": []}
    timed = batches[sft.WARMUP :]
    for index in range(ROUNDS):
        chunk = timed[(index * STEPS_PER_ROUND) % len(timed) :][:STEPS_PER_ROUND]
        order = ("ddp", "fsdp") if index % 2 == 0 else ("fsdp", "ddp")
        for mode in order:
            per_rank = pools[mode].run(sft.ours_steps, chunk, timeout_s=600)
            parts[mode].append({"seconds": max(r["seconds"] for r in per_rank), **per_rank[0]})
        ddp, fsdp = parts["ddp"][-1], parts["fsdp"][-1]
        print(
            f"[{NAME}] round {index + 1}: ddp {ddp['tokens'] / ddp['seconds']:,.0f} tok/s, "
            f"fsdp {fsdp['tokens'] / fsdp['seconds']:,.0f} tok/s",
            flush=True,
        )
    for pool in pools.values():
        pool.close()
    speed = {m: sum(p["tokens"] for p in ps) / sum(p["seconds"] for p in ps) for m, ps in parts.items()}
    rounds = [(d["tokens"] / d["seconds"]) / (f["tokens"] / f["seconds"]) for d, f in zip(parts["ddp"], parts["fsdp"])]
    gap = max(abs(a - b) for d, f in zip(parts["ddp"], parts["fsdp"]) for a, b in zip(d["losses"], f["losses"]))
    ratio = speed["ddp"] / speed["fsdp"]
    result = {
        "benchmark": NAME,
        "description": "SFT real tokens/s on 2 ranks x 1 thread: DDP (r2) vs FSDP (d2), alternated rounds",
        "tokens_per_s": speed,
        "ratio": ratio,
        "round_ratios": rounds,
        "max_abs_loss_gap": gap,
        "model": sft.MODEL,
        "machine": info,
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    json_path = _common.write_json(NAME, result)
    _common.upsert_result_row(
        benchmark=NAME,
        metric=f"SFT real tokens/s, DDP r2 vs FSDP d2 ({WORLD} ranks x 1 thread), median of paired rounds",
        ours=f"{speed['ddp']:,.0f}",
        baseline=f"{speed['fsdp']:,.0f}",
        ratio=f"{ratio:.2f} (rounds {min(rounds):.2f}..{max(rounds):.2f})",
        target="report",
        machine=_common.machine_label(info),
    )
    print(
        f"[{NAME}] ddp {speed['ddp']:,.0f} vs fsdp {speed['fsdp']:,.0f} tokens/s: {ratio:.2f}x "
        f"(rounds {min(rounds):.2f}..{max(rounds):.2f}); max |loss gap| {gap:.2e}; wrote {json_path}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
