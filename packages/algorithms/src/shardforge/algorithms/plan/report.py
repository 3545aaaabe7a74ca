"""`shardforge plan`: the command line, the table and the JSON output."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from shardforge.algorithms.plan.fsdp_tuning import suggest_fsdp
from shardforge.algorithms.plan.layouts import PlanResult, plan_layouts
from shardforge.algorithms.plan.memory import MemoryEstimate
from shardforge.algorithms.plan.options import PlanOptions, parse_memory
from shardforge.algorithms.plan.presets import PRESETS, load_model_config
from shardforge.algorithms.plan.stats import model_stats

__all__ = ["add_plan_parser", "format_table", "run_plan"]

_GIB = 2**30
_MIB = 2**20


def add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on the ``shardforge`` sub-command parser."""
    p = sub.add_parser(
        "plan",
        help="predict per-rank memory of every layout and rank those that fit",
        description="Enumerate valid ParallelDims for a model and world size, predict per-rank peak memory "
        "(params, grads, optimizer state, activations, communication buffers) and rank the layouts that fit.",
    )
    p.add_argument("model", help=f"preset ({', '.join(sorted(PRESETS))}), a config.json, or an HF model directory")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
    p.add_argument("--seq-len", type=int, required=True, help="longest sequence (tokens)")
    p.add_argument("--micro-batch-tokens", type=int, help="max_tokens_per_microbatch (default: seq-len)")
    p.add_argument("--num-microbatches", type=int, default=1, help="micro-batches per optimizer step per rank")
    p.add_argument("--memory", help="per-device memory budget, e.g. 80GiB (omit: no budget)")
    p.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of --memory kept free for what the model does not predict (allocator caching and "
        "fragmentation, NCCL/cuBLAS workspaces, the CUDA context); default 0.1",
    )
    p.add_argument("--param-dtype", default="bf16", help="stored parameter dtype (fp32 / bf16)")
    p.add_argument("--compute-dtype", default=None, help="FSDP mixed-precision compute dtype (default: param dtype)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "anyprecision_adamw"])
    p.add_argument("--ac", default="none", choices=["none", "full", "selective"], help="activation checkpointing")
    p.add_argument("--ac-every", type=int, default=2, help="selective AC: every k-th layer")
    p.add_argument("--tiled-mlp", type=int, default=1, help="tiled MLP shards (1 = off)")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload of params/grads/optimizer")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0 = full fine-tuning)")
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated linear names")
    p.add_argument("--no-sequence-parallel", action="store_true", help="TP without sequence parallelism")
    p.add_argument("--attention", default="flash", choices=["flash", "cpu"], help="attention back-end to model")
    p.add_argument("--pp-schedule", default="1F1B", help="pipeline schedule for pp > 1")
    p.add_argument("--layout", action="append", help="only evaluate this layout (repeatable), e.g. d8t8")
    p.add_argument("--top", type=int, default=20, help="rows to print (0 = all)")
    p.add_argument("--all", action="store_true", help="also list layouts that do not fit")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p  # type: ignore[no-any-return]


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    return PlanOptions(
        seq_len=args.seq_len,
        micro_batch_tokens=args.micro_batch_tokens or args.seq_len,
        num_microbatches=args.num_microbatches,
        param_dtype=args.param_dtype,
        compute_dtype=args.compute_dtype,
        optimizer=args.optimizer,
        activation_checkpointing=args.ac,
        checkpoint_every=args.ac_every,
        tiled_mlp_shards=args.tiled_mlp,
        cpu_offload=args.cpu_offload,
        lora_rank=args.lora_rank,
        lora_targets=tuple(t for t in args.lora_targets.split(",") if t),
        sequence_parallel=not args.no_sequence_parallel,
        attention=args.attention,
        pp_schedule=args.pp_schedule,
    )


def _count(n: int) -> str:
    """1234567 -> '1.23M' (B, M or K, so a tiny model is not '0.00B')."""
    for suffix, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{suffix}"
    return str(n)


def table_unit(rows: list[MemoryEstimate]) -> tuple[str, int]:
    """The largest binary unit in which the biggest total is >= 1 (tiny models print KiB, not 0.00)."""
    largest = max((e.total for e in rows), default=0)
    for name, size in (("GiB", _GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "B", 1


def layout_string(dims: Any) -> str:
    """A layout as the CLI's ``layout=`` accepts it, size-1 axes left out (``r64d16``, ``p2d4t2``)."""
    axes = (("p", dims.pp), ("r", dims.dp_replicate), ("d", dims.dp_shard), ("c", dims.cp), ("t", dims.tp),
            ("e", dims.ep), ("x", dims.etp))  # fmt: skip
    return "".join(f"{letter}{size}" for letter, size in axes if size > 1 or letter == "d")


def format_table(rows: list[MemoryEstimate], budget: int | None) -> str:
    """A fixed-width table of layouts (in the CLI's form) and their predicted peak breakdown, in
    the unit `table_unit` picks (named in the header)."""
    unit, size = table_unit(rows)
    header = ("layout", f"params {unit}", "grads", "optim", "activ", "comm", "total", "peak at", "fits")
    lines: list[tuple[str, ...]] = [header]
    for e in rows:
        layout = layout_string(e.dims) + (" ddp" if getattr(e, "data_parallel", "fsdp") == "ddp" else "")
        fits = "-" if budget is None else ("yes" if e.total <= budget else "no")
        vals = (e.params, e.grads, e.optim, e.activations, e.comm, e.total)
        lines.append((layout, *(f"{v / size:.2f}" for v in vals), e.phase, fits))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in lines
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def run_plan(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom={args.headroom} must be in [0, 1) (a fraction of --memory)")
    device = parse_memory(args.memory) if args.memory else None
    budget = int(device * (1 - args.headroom)) if device is not None else None
    opts = options_from_args(args)
    config = load_model_config(args.model)
    stats = model_stats(config)
    built = time.perf_counter()
    result: PlanResult = plan_layouts(stats, args.world_size, opts, budget, layouts=args.layout)
    total_s = time.perf_counter() - started
    suggestion = suggest_fsdp(stats, result.fitting[0], opts, budget) if result.fitting else None
    if args.json:
        payload = result.as_dict()
        payload.update(
            model=str(args.model),
            num_params=stats.num_params,
            options={k: getattr(opts, k) for k in opts.__slots__},  # type: ignore[attr-defined]
            meta_build_s=built - started,
            total_s=total_s,
            fsdp_settings=suggestion.as_dict() if suggestion else None,
        )
        print(json.dumps(payload, indent=2, default=str))
        return 0
    rows = result.fitting + (result.too_big if args.all or not result.fitting else [])
    shown = rows if args.top == 0 else rows[: args.top]
    budget_text = (
        f"{budget / _GIB:.2f} GiB = {device / _GIB:.2f} GiB less {args.headroom:.0%} headroom"
        if budget is not None and device is not None
        else "none"
    )
    print(
        f"{args.model}: {_count(stats.num_params)} params, world {args.world_size}, "
        f"{result.timings['layouts']:.0f} valid layouts, {len(result.fitting)} fit the budget ({budget_text}); "
        f"meta build {built - started:.2f}s, plan {result.seconds:.2f}s. Per-rank memory at the predicted peak:"
    )
    print(format_table(shown, budget))
    for layout, why in result.rejected:
        print(f"layout {layout} not planned: {why}")
    if suggestion is not None:
        cost = (
            f"+{suggestion.extra_bytes / _MIB:.1f} MiB predicted peak, fits"
            if suggestion.extra_bytes
            else "predicted peak unchanged"
        )
        print(
            f"FSDP settings for {layout_string(result.fitting[0].dims)}: {suggestion.cli()} "
            f"(measured {suggestion.gain} step speed on CPU, docs/planner.md; {cost})"
        )
    if any(getattr(e, "data_parallel", "fsdp") == "ddp" for e in shown):
        print(
            "'rN ddp': layout=rN engine.data_parallel=ddp (a whole model per rank, gradients all-reduced in buckets; "
            "'rN' alone is FSDP over the N replicas)"
        )
    if budget is not None and not result.fitting:
        print("nothing fits: try activation checkpointing (--ac full), more ranks, --cpu-offload or LoRA")
    if len(rows) > len(shown):
        print(f"... {len(rows) - len(shown)} more (--top 0 shows all)")
    return 0
