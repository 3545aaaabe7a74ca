"""Where an SFT step's time goes at world 1 (H100, bf16, 1B Llama shape, packed, AC off).

Usage (GPU machine): ``python3 benchmarks/gpu/bench_step_breakdown.py [--shape 1b] [--seq 4096]``;
without CUDA it prints "no CUDA device" and exits 0.

bench_mfu's torchtitan anchor (a plain loop: forward, cross-entropy, backward, fused AdamW) ran
1.75-2.5x faster than our `TrainEngine` on the same model and tokens, with a gap that grows with the
parameter count rather than the tokens: a per-parameter cost. This script times the engine's step
with the optimizer (eager or fused/compiled) and clipping switched one at a time, and profiles one
default step (top CUDA ops and the optimizer's own annotation) so the gap can be attributed.
First H100 run (2026-11-26, before the compiled update existed): AnyPrecisionAdamW eager 199.8 ms,
no clip 209.6 ms, torch AdamW foreach=False 144.1 ms; the optimizer was 88 of 176 ms of CUDA time.
H200 (2026-11-27): eager 176.0 ms, compiled one parameter per call 142.5 ms (optimizer 40 ms of host
time for 7.7 ms of GPU time), compiled 64 per call 118.5 ms, torch fused AdamW 105-107 ms.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _gpu_common import device_info, device_label, free_cuda, import_packages, require_cuda, write_json
from bench_mfu import document_lengths, save_model

VOCAB = 128256


def _engine(path: str, seq: int, optimizer: dict[str, Any]) -> Any:
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    config = EngineConfig(
        param_dtype="bfloat16", optimizer=OptimizerConfig(lr=1e-5, **optimizer), max_tokens_per_microbatch=seq
    )
    return TrainEngine(path, "d-1", config)


def _batch(seq: int) -> Any:
    import torch

    from shardforge.engine import pack_sequences

    gen = torch.Generator().manual_seed(0)
    lengths = document_lengths(seq)
    return pack_sequences([torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths],
                          [[1.0] * n for n in lengths])  # fmt: skip


def _time(engine: Any, batch: Any, steps: int = 5) -> float:
    import torch

    engine.train_batch(batch)
    engine.train_batch(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_batch(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--model-root", default="/tmp/shardforge_bench_mfu")
    args = parser.parse_args()
    require_cuda("bench_step_breakdown.py")
    import_packages()
    import torch
    from torch.profiler import ProfilerActivity, profile

    info = device_info()
    path = save_model(args.shape, args.seq, args.model_root)
    batch = _batch(args.seq)
    variants = {
        "anyprecision_adamw (kahan), compiled [default on CUDA]": {"name": "anyprecision_adamw"},
        "anyprecision_adamw (kahan), eager (fused=False)": {"name": "anyprecision_adamw", "fused": False},
        "anyprecision_adamw (kahan), compiled, no clip": {"name": "anyprecision_adamw", "max_grad_norm": None},
        "torch adamw, fused [default on CUDA]": {"name": "adamw"},
        "torch adamw, foreach=False": {"name": "adamw", "fused": False},
    }
    results: dict[str, Any] = {}
    for label, opt in variants.items():
        engine = _engine(path, args.seq, opt)
        results[label] = {"step_s": _time(engine, batch)}
        print(f"{label:60} {results[label]['step_s'] * 1e3:8.1f} ms/step", flush=True)
        del engine
        free_cuda()
    engine = _engine(path, args.seq, {"name": "anyprecision_adamw"})
    engine.train_batch(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.train_batch(batch)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    steps = [e for e in prof.key_averages() if e.key.startswith("Optimizer.") or "clip" in e.key.lower()]
    print(table)
    for e in steps:
        print(f"{e.key:70} cpu {e.cpu_time_total / 1e3:8.1f} ms  device {e.device_time_total / 1e3:8.1f} ms")
    results["profile_top"] = table
    results["annotations"] = {e.key: {"cpu_ms": e.cpu_time_total / 1e3, "device_ms": e.device_time_total / 1e3}
                              for e in steps}  # fmt: skip
    write_json("bench_step_breakdown", {"device": info, "shape": args.shape, "seq": args.seq, "results": results})
    print(device_label(info))


if __name__ == "__main__":
    main()
