"""The layout planner (`shardforge plan`): predicted vs measured per-rank peak memory on CPU.

For each layout below, a `TrainEngine` runs one steady-state ``train_batch`` (after a
warm-up step that creates the optimizer state) on gloo rank pools, and
`shardforge.algorithms.plan.measure` counts the live bytes of every tensor storage on each
rank (a `TorchDispatchMode` sees every op's outputs; FSDP2's resized all-gather storages are
polled), so the measured peak includes sharded params, optimizer state, gradients,
activations, logits and the loss, gathered FSDP units and reduce-scatter buffers. The
planner predicts the same run from shapes alone (`predict_engine_peak`: the memory model
with the CPU attention path). Target: predicted / measured within 1 +- 0.15 for every layout.

It also times the planner itself on the large presets (meta build + enumeration + ranking).

Model: Qwen3, hidden 256, MLP 768, 4 layers, 8 query / 4 kv heads of 32, vocab 4096, fp32
params, 1024 tokens per rank per step (4 sequences of 256) in one micro-batch.

Run: ``python benchmarks/bench_planner.py`` from the repo root (a few minutes on 2 cores);
``--strict`` exits 1 when a layout misses the target.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "planner"
TOLERANCE = 0.15
SEQ_LEN = 256
TOKENS = 1024
MODEL = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
_LORA_ALL = {
    "r": 8,
    "alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
# (label, layout, world size, EngineConfig options)
CASES: list[tuple[str, str, int, dict[str, Any]]] = [
    ("1 rank", "d1", 1, {}),
    ("1 rank, AC full", "d1", 1, {"activation_checkpointing": "full"}),
    ("FSDP 2", "d2", 2, {}),
    ("FSDP 2, bf16 compute", "d2", 2, {"compute_dtype": "bf16"}),
    ("FSDP 2, AC full", "d2", 2, {"activation_checkpointing": "full"}),
    ("FSDP 2, AC every 2nd", "d2", 2, {"activation_checkpointing": "selective", "checkpoint_every": 2}),
    ("FSDP 2, no reshard", "d2", 2, {"reshard_after_forward": False}),
    ("FSDP 2, tiled MLP x4", "d2", 2, {"tiled_mlp_shards": 4}),
    (
        "FSDP 2, AnyPrecisionAdamW, bf16",
        "d2",
        2,
        {"param_dtype": "bfloat16", "optimizer": {"name": "anyprecision_adamw"}},
    ),
    ("TP 2", "d1t2", 2, {}),
    ("FSDP 4", "d4", 4, {}),
    ("HSDP 2x2", "r2d2", 4, {}),
    ("FSDP 2 x TP 2", "d2t2", 4, {}),
    ("FSDP 2 x TP 2, bf16, AC full", "d2t2", 4, {"compute_dtype": "bf16", "activation_checkpointing": "full"}),
    ("FSDP 2 x CP 2", "d2c2", 4, {}),
    ("FSDP 2, LoRA r=8 on q,v", "d2", 2, {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}),
    ("1 rank, LoRA r=8 on all, AC full", "d1", 1, {"lora": _LORA_ALL, "activation_checkpointing": "full"}),
    ("FSDP 2 x TP 2, LoRA r=8 on all", "d2t2", 4, {"lora": _LORA_ALL}),
]
SPEED = [("llama3-8b", 64), ("llama3-70b", 1024), ("qwen3-30b-a3b", 256)]


def _on_ranks(world: int, layout: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    from shardforge.algorithms.plan.measure import measure_on_ranks

    return measure_on_ranks(
        MODEL, layout, world, seq_len=SEQ_LEN, micro_batch_tokens=TOKENS, engine_options=options, timeout_s=900
    )


def planner_speed() -> list[dict[str, Any]]:
    from shardforge.algorithms.plan import PlanOptions, load_model_config, model_stats, parse_memory, plan_layouts

    out = []
    for preset, world in SPEED:
        started = time.perf_counter()
        stats = model_stats(load_model_config(preset))
        built = time.perf_counter()
        opts = PlanOptions(seq_len=8192, micro_batch_tokens=8192, compute_dtype="bf16", param_dtype="fp32")
        result = plan_layouts(stats, world, opts, parse_memory("80GiB"))
        out.append(
            {
                "preset": preset,
                "world_size": world,
                "meta_build_s": built - started,
                "plan_s": result.seconds,
                "layouts": result.timings["layouts"],
                "fitting": len(result.fitting),
                "best": result.fitting[0].dims.to_string() if result.fitting else None,
            }
        )
        print(f"[{NAME}] speed {out[-1]}", flush=True)
    return out


def plot(rows: list[dict[str, Any]], png: Path) -> None:
    plt = _common.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.4]})
    measured = [r["measured_mib"] for r in rows]
    predicted = [r["predicted_mib"] for r in rows]
    top = max(measured + predicted) * 1.1
    ax.plot([0, top], [0, top], color="black", lw=1, label="predicted = measured")
    ax.fill_between([0, top], [0, top * (1 - TOLERANCE)], [0, top * (1 + TOLERANCE)], color="#cccccc", alpha=0.5)
    ax.scatter(measured, predicted, color="#4c72b0", zorder=3)
    for r in rows:
        ax.annotate(r["label"], (r["measured_mib"], r["predicted_mib"]), fontsize=6, xytext=(3, -3),
                    textcoords="offset points")  # fmt: skip
    ax.set_xlabel("measured peak MiB per rank (max over ranks)")
    ax.set_ylabel("predicted peak MiB per rank")
    ax.set_title(f"planner vs measurement (band: +-{TOLERANCE:.0%})")
    ax.legend(fontsize=7, loc="upper left")
    xs = range(len(rows))
    bx.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured", color="#55a868")
    bx.bar([x + 0.2 for x in xs], predicted, width=0.4, label="predicted", color="#4c72b0")
    bx.set_xticks(list(xs), [r["label"] for r in rows], rotation=60, ha="right", fontsize=7)
    bx.set_ylabel("peak MiB per rank")
    bx.set_title("one train_batch, Qwen3 h256 x 4 layers, vocab 4096, 1024 tokens/rank, fp32 params")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    from shardforge.algorithms.plan.measure import predict_engine_peak
    from shardforge.mesh.testing import get_rank_pool

    started = time.perf_counter()
    info = _common.machine_info()
    rows: list[dict[str, Any]] = []
    for label, layout, world, options in CASES:
        t0 = time.perf_counter()
        per_rank = _on_ranks(world, layout, options)
        est = predict_engine_peak(
            MODEL, layout, world, seq_len=SEQ_LEN, micro_batch_tokens=TOKENS, engine_options=options
        )
        measured = max(r["peak_bytes"] for r in per_rank)
        row = {
            "label": label,
            "layout": layout,
            "world_size": world,
            "engine_options": options,
            "measured_mib": measured / 2**20,
            "predicted_mib": est.total / 2**20,
            "ratio": est.total / measured,
            "predicted": est.as_dict(),
            "measured_per_rank": per_rank,
            "seconds": time.perf_counter() - t0,
        }
        row["met"] = abs(row["ratio"] - 1) <= TOLERANCE
        rows.append(row)
        print(
            f"[{NAME}] {label:32s} measured {row['measured_mib']:8.2f} MiB  predicted {row['predicted_mib']:8.2f} MiB"
            f"  ratio {row['ratio']:.3f}  (peak at {est.phase}; {row['seconds']:.0f} s)",
            flush=True,
        )
    for world in (2, 4):
        get_rank_pool(world).close()
    speed = planner_speed()
    result = {
        "benchmark": NAME,
        "description": "predicted / measured per-rank peak bytes of one train_batch (max over ranks)",
        "tolerance": TOLERANCE,
        "model": MODEL,
        "seq_len": SEQ_LEN,
        "tokens_per_rank": TOKENS,
        "rows": rows,
        "planner_speed": speed,
        "machine": info,
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    json_path = _common.write_json(NAME, result)
    png = _common.png_path(NAME)
    plot(rows, png)
    ratios = [r["ratio"] for r in rows]
    met = all(r["met"] for r in rows)
    worst = max(ratios, key=lambda x: abs(x - 1))
    _common.upsert_result_row(
        benchmark=f"{NAME} (predicted vs measured)",
        metric=f"per-rank peak MiB of one train_batch, {len(rows)} layouts, planner vs storage-tracked measurement (CPU, Qwen3 h256 x 4, "
        "vocab 4096, 1024 tokens/rank); ratio range [worst]",
        ours=f"{min(ratios):.3f} .. {max(ratios):.3f}",
        baseline="1.00 (measured)",
        ratio=f"{worst:.3f}",
        target=_common.target_cell(f"within 1 +- {TOLERANCE:.2f}", met),
        machine=_common.machine_label(info),
    )
    slowest = max(speed, key=lambda s: s["meta_build_s"] + s["plan_s"])
    _common.upsert_result_row(
        benchmark=f"{NAME}_speed",
        metric="seconds to plan (meta build + enumerate + predict + rank), "
        + " / ".join(f"{s['preset']} world {s['world_size']}" for s in speed),
        ours=" / ".join(f"{s['meta_build_s'] + s['plan_s']:.2f}" for s in speed),
        baseline="-",
        ratio="-",
        target=_common.target_cell("seconds on a laptop (< 10 s)", slowest["meta_build_s"] + slowest["plan_s"] < 10),
        machine=_common.machine_label(info),
    )
    print(f"[{NAME}] wrote {json_path}, {png} and rows in {_common.RESULTS_MD}; {time.perf_counter() - started:.0f} s")
    return 1 if not met and "--strict" in sys.argv[1:] else 0


if __name__ == "__main__":
    sys.exit(main())
