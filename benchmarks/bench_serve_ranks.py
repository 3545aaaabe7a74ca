"""`shardforge serve --nproc-per-node 2` vs one rank: tokens/s of one LoRA tenant's training steps.

Setup as `bench_serve.py` (tiny Qwen3 hidden ``HIDDEN``, LoRA rank 8 on every attention and MLP linear, batches of
``BATCH`` addition strings of ~9 tokens, AdamW, the tinker SDK over HTTP on 127.0.0.1), with two services in
processes of their own: ``shardforge serve`` on one rank, and ``shardforge serve --nproc-per-node 2`` (the base
sharded over 2 gloo ranks with FSDP, each rank running half of every step's rows). Metric: tokens/s of
``forward_backward("cross_entropy")`` + ``optim_step``, median of ``ROUNDS`` alternated rounds of ``STEPS`` steps
after ``WARMUP``. ``--layout t2``: the 2-rank service tensor-parallel instead (`serve.tp_lora`; rows
``serve_ranks_t2*``). No target: a number (on a 2-core CPU the 2 ranks' FSDP all-gathers and the job broadcast cost
about what splitting the rows saves). Run: ``python benchmarks/bench_serve_ranks.py [--hidden H --layers L]`` (~1 min
at the defaults; a larger model is a row of its own, ``serve_ranks_h<H>``). ``--full``: a full fine-tuning client
instead (every weight trained; on 2 ranks its copy and AdamW state sharded with FSDP too), row ``serve_ranks_full``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from bench_serve import BATCH, HIDDEN, RANK, STEPS, WARMUP, _datums, _service_steps

NAME = "serve_ranks"
ROUNDS = 5


def _full_steps(url: str, key: str, tokenizer: Any, steps: int, seed: int) -> tuple[int, float, float]:
    """As `bench_serve._service_steps`, for a new full fine-tuning client."""
    import tinker
    from tinker import types

    from shardforge.algorithms.serve.client import create_full_training_client

    with tinker.ServiceClient(base_url=url, api_key=key) as client:
        trainer = create_full_training_client(client, "tiny")
        adam = types.AdamParams(learning_rate=1e-4)
        for step in range(WARMUP):
            trainer.forward_backward(_datums(tokenizer, seed * 1000 + step), "cross_entropy").result()
            trainer.optim_step(adam).result()
        tokens, start = 0, time.perf_counter()
        for step in range(steps):
            datums = _datums(tokenizer, seed * 1000 + WARMUP + step)
            tokens += sum(len(d.model_input.to_ints()) for d in datums)
            fwdbwd = trainer.forward_backward(datums, "cross_entropy")
            optim = trainer.optim_step(adam)
            fwdbwd.result()
            optim.result()
        return tokens, start, time.perf_counter()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the tiny Qwen3's hidden size")
    parser.add_argument("--layers", type=int, default=2, help="its decoder layers")
    parser.add_argument("--full", action="store_true", help="a full fine-tuning client instead of LoRA")
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
                    steps = _full_steps if args.full else _service_steps
                    tokens, start, end = steps(service.url, key, tiny["tokenizer"], STEPS, round_)
                    rates[n].append(tokens / (end - start))
                loads.append(os.getloadavg()[0])
        finally:
            for service in services.values():
                service.stop()
    info = _common.machine_info()
    ratio = statistics.median(two / one for one, two in zip(rates[1], rates[2], strict=True))
    payload = {
        "machine": info, "batch": BATCH, "steps": STEPS, "warmup": WARMUP, "rounds": ROUNDS, "lora_rank": RANK,
        "hidden": args.hidden, "layers": args.layers, "full": args.full, "layout": args.layout,
        "tokens_s_1_rank": rates[1], "tokens_s_2_ranks": rates[2], "ratio": ratio, "load_average_1min": loads,
    }  # fmt: skip
    name = NAME if (args.hidden, args.layers) == (HIDDEN, 2) else f"{NAME}_h{args.hidden}"
    name = name if args.layout == "d2" else name.replace(NAME, f"{NAME}_{args.layout}")
    name += "_full" if args.full else ""
    what = "full fine-tuning (every weight)" if args.full else f"LoRA r{RANK}"
    how = {"d2": "base FSDP-sharded over 2 gloo ranks, rows split",
           "t2": "base tensor-parallel over 2 gloo ranks with sequence parallelism, adapters replicated"}.get(
        args.layout, f"--layout {args.layout}")  # fmt: skip
    if args.full:
        how = how.replace("base FSDP-sharded", "base and the client's copy + AdamW FSDP-sharded")
    _common.write_json(name, payload)
    _common.upsert_result_row(
        benchmark=name,
        metric=f"{what} training tokens/s of one tenant (forward_backward + optim_step, tinker SDK over HTTP), "
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
