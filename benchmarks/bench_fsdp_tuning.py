"""FSDP tuning choices on 2 ranks: reshard after forward, layers per unit, forward prefetch.

Same Qwen3 as the SFT-throughput benchmark (3.2M weights, 4 decoder layers), same initial weights,
same global batches in the same order, FSDP over 2 ranks (`d2`), one thread per rank. One rank pool
per variant, run alternately round by round so every variant sees the same machine load. Reports
real tokens/s of each variant relative to the default (reshard after forward, one layer per unit,
no explicit prefetch) and the largest loss gap to the default (the variants do the same math: this
compares speed, not work).

Run: ``python benchmarks/bench_fsdp_tuning.py`` from the repo root (a few minutes).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import bench_sft_throughput as sft

NAME = "fsdp_tuning"
WORLD = 2
ROUNDS = 3
STEPS_PER_ROUND = 2
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "no_reshard": {"reshard_after_forward": False},
    "2_layers_per_unit": {"fsdp_layers_per_unit": 2},
    "prefetch_1": {"fsdp_forward_prefetch": 1},
    "no_reshard+2_layers+prefetch": {
        "reshard_after_forward": False, "fsdp_layers_per_unit": 2, "fsdp_forward_prefetch": 1,
    },
}  # fmt: skip


def setup(variant: dict[str, Any]) -> str:
    """On each rank: build the d2 engine with the variant's FSDP settings."""
    import torch
    from transformers import Qwen3Config

    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    torch.set_num_threads(1)
    config = EngineConfig(
        optimizer=OptimizerConfig(lr=sft.LR, max_grad_norm=sft.MAX_GRAD_NORM), seed=sft.SEED, **variant
    )
    sft._worker_state()["engine"] = TrainEngine(Qwen3Config(**sft.MODEL), f"d{WORLD}", config)
    return "ok"


def main() -> int:
    from shardforge.mesh.testing.pool import RankPool

    started = time.perf_counter()
    info = _common.machine_info()
    batches, _ = sft.make_batches()
    pools = {name: RankPool(WORLD) for name in VARIANTS}
    for name, pool in pools.items():
        pool.run(setup, VARIANTS[name], timeout_s=600)
        pool.run(sft.ours_steps, batches[: sft.WARMUP], timeout_s=600)
    parts: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    timed = batches[sft.WARMUP :]
    names = list(VARIANTS)
    for index in range(ROUNDS):
        chunk = timed[(index * STEPS_PER_ROUND) % len(timed) :][:STEPS_PER_ROUND]
        for name in names[index % len(names) :] + names[: index % len(names)]:  # rotate the order
            per_rank = pools[name].run(sft.ours_steps, chunk, timeout_s=600)
            parts[name].append({"seconds": max(r["seconds"] for r in per_rank), **per_rank[0]})
        print(f"[{NAME}] round {index + 1} done", flush=True)
    for pool in pools.values():
        pool.close()

    def speed(part: dict[str, Any]) -> float:
        return part["tokens"] / part["seconds"]

    summary = {}
    for name, ps in parts.items():
        ratios = [speed(p) / speed(d) for p, d in zip(ps, parts["default"], strict=True)]
        gap = max(abs(a - b) for p, d in zip(ps, parts["default"]) for a, b in zip(p["losses"], d["losses"]))
        summary[name] = {
            "tokens_per_s": sum(p["tokens"] for p in ps) / sum(p["seconds"] for p in ps),
            "ratio_to_default_median": statistics.median(ratios),
            "round_ratios": ratios,
            "max_abs_loss_gap": gap,
        }
    result = {
        "benchmark": NAME,
        "description": "SFT real tokens/s on d2 x 1 thread per FSDP variant, alternated rounds",
        "variants": VARIANTS,
        "summary": summary,
        "model": sft.MODEL,
        "machine": info,
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    json_path = _common.write_json(NAME, result)
    best = max((n for n in VARIANTS if n != "default"), key=lambda n: summary[n]["ratio_to_default_median"])
    _common.upsert_result_row(
        benchmark=NAME,
        metric="SFT real tokens/s on d2, best FSDP variant vs default (median of paired rounds)",
        ours=f"{best}: {summary[best]['tokens_per_s']:,.0f}",
        baseline=f"default: {summary['default']['tokens_per_s']:,.0f}",
        ratio=f"{summary[best]['ratio_to_default_median']:.2f}",
        target="report",
        machine=_common.machine_label(info),
    )
    for name, row in summary.items():
        print(
            f"[{NAME}] {name}: {row['tokens_per_s']:,.0f} tok/s, x{row['ratio_to_default_median']:.2f} vs default, "
            f"max |loss gap| {row['max_abs_loss_gap']:.1e}",
            flush=True,
        )
    print(f"[{NAME}] wrote {json_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
