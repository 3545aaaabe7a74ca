"""`shardforge serve --nproc-per-node 2` vs one rank: tokens/s of one LoRA tenant's training steps.

Setup as `bench_serve.py` (tiny Qwen3 hidden ``HIDDEN``, LoRA rank 8 on every attention and MLP linear, batches of
``BATCH`` addition strings of ~9 tokens, AdamW, the tinker SDK over HTTP on 127.0.0.1), with two services in
processes of their own: ``shardforge serve`` on one rank, and ``shardforge serve --nproc-per-node 2`` (the base
sharded over 2 gloo ranks with FSDP, each rank running half of every step's rows). Metric: tokens/s of
``forward_backward("cross_entropy")`` + ``optim_step``, median of ``ROUNDS`` alternated rounds of ``STEPS`` steps
after ``WARMUP``. ``--layout t2``: the 2-rank service tensor-parallel instead (`serve.tp_lora`; rows
``serve_ranks_t2*``). No target: a number (on a 2-core CPU the 2 ranks' FSDP all-gathers and the job broadcast cost
about what splitting the rows saves). Run: ``python benchmarks/bench_serve_ranks.py [--hidden H --layers L]`` (~1 min
at the defaults; a larger model is a row of its own, ``serve_ranks_h<H>``).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from bench_serve import BATCH, HIDDEN, RANK, STEPS, WARMUP, _service_steps

NAME = "serve_ranks"
ROUNDS = 5


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the tiny Qwen3's hidden size")
    parser.add_argument("--layers", type=int, default=2, help="its decoder layers")
    parser.add_argument(
        "--layout", default="d2", help="the 2-rank service's --layout: d2 (FSDP, rows split) or t2 (tensor parallel)"
    )
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from shardforge.algorithms.testing.serve_process import ServeProcess
    from shardforge.rollout.testing.tiny import tiny_model

    key = "tml-bench-ranks-0123456789"
    with tempfile.TemporaryDirectory(prefix="bench_serve_ranks_") as tmp:
        tiny = tiny_model(Path(tmp), hidden=args.hidden, layers=args.layers)
        services = {
            n: ServeProcess(tiny["model"], {key: "bench"}, Path(tmp) / f"out{n}", nproc=n,
                            extra=["--layout", args.layout] if n > 1 else [])
            for n in (1, 2)
        }  # fmt: skip
        rates: dict[int, list[float]] = {1: [], 2: []}
        loads = [os.getloadavg()[0]]
        try:
            for round_ in range(ROUNDS):
                for n, service in services.items():
                    tokens, start, end = _service_steps(service.url, key, tiny["tokenizer"], STEPS, round_)
                    rates[n].append(tokens / (end - start))
                loads.append(os.getloadavg()[0])
        finally:
            for service in services.values():
                service.stop()
    info = _common.machine_info()
    ratio = statistics.median(two / one for one, two in zip(rates[1], rates[2], strict=True))
    payload = {
        "machine": info, "batch": BATCH, "steps": STEPS, "warmup": WARMUP, "rounds": ROUNDS, "lora_rank": RANK,
        "hidden": args.hidden, "layers": args.layers, "layout": args.layout, "tokens_s_1_rank": rates[1], "tokens_s_2_ranks": rates[2], "ratio": ratio,
        "load_average_1min": loads,
    }  # fmt: skip
    name = NAME if (args.hidden, args.layers) == (HIDDEN, 2) else f"{NAME}_h{args.hidden}"
    name = name if args.layout == "d2" else name.replace(NAME, f"{NAME}_{args.layout}")
    how = {"d2": "base FSDP-sharded over 2 gloo ranks, rows split",
           "t2": "base tensor-parallel over 2 gloo ranks with sequence parallelism, adapters replicated"}.get(
        args.layout, f"--layout {args.layout}")  # fmt: skip
    _common.write_json(name, payload)
    _common.upsert_result_row(
        benchmark=name,
        metric=f"LoRA r{RANK} training tokens/s of one tenant (forward_backward + optim_step, tinker SDK over HTTP), "
        f"tiny Qwen3 hidden {args.hidden}, {args.layers} layers, {BATCH} rows/step: `shardforge serve --nproc-per-node 2` ({how}) "
        f"vs 1 rank, each in its own process; median of {ROUNDS} alternated rounds; "
        f"1-min load {min(loads):.1f}-{max(loads):.1f}",
        ours=f"{statistics.median(rates[2]):,.0f}",
        baseline=f"{statistics.median(rates[1]):,.0f}",
        ratio=f"{ratio:.2f}",
        target="report (no target)",
        machine=_common.machine_label(info),
    )
    print(f"2 ranks / 1 rank: {ratio:.2f}x ({statistics.median(rates[2]):,.0f} vs {statistics.median(rates[1]):,.0f})")


if __name__ == "__main__":
    main()
