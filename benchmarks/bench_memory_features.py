"""Peak memory of one training step with each memory feature off vs on (same model, same batch).

Every row runs the real `TrainEngine.train_batch` twice (a warm-up step creates the optimizer
state, the second is measured) and counts the live bytes of every tensor storage on each rank
with `shardforge.algorithms.plan.measure` (a `TorchDispatchMode`; FSDP2's resized all-gather
storages are polled). Where the planner models the option, its prediction for the same run is
shown next to the measurement (`predict_engine_peak`).

Features: activation checkpointing (full), tiled MLP (4 sequence chunks), AnyPrecisionAdamW
(bf16 params + bf16 moments + Kahan buffer, vs fp32 params + fp32 AdamW), LoRA (r=8 on every
attention and MLP projection, vs full fine-tuning), FSDP CPU offload and `offload_when_idle`.
The two offload features move state from the accelerator to host memory: on a CPU-only machine
both are host memory, so the measured total cannot change; those rows report the measurement
and the planner's device-memory prediction, and say so.

Model: Qwen3, hidden 256, MLP 1024, 4 layers, 8 query / 4 kv heads of 32, vocab 2048, fp32,
4096 tokens per rank per step (4 sequences of 1024) in one micro-batch.

Run: ``python benchmarks/bench_memory_features.py`` from the repo root (a few minutes on 2 cores).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "memory_features"
SEQ_LEN = 1024
TOKENS = 4096
MODEL = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _cases() -> list[tuple[str, str, int, dict[str, Any], dict[str, Any], bool]]:
    """(feature, layout, world, options off, options on, measurable on CPU)."""
    cases: list[tuple[str, str, int, dict[str, Any], dict[str, Any], bool]] = [
        ("activation checkpointing (full)", "d1", 1, {}, {"activation_checkpointing": "full"}, True),
        ("tiled MLP (4 chunks)", "d1", 1, {}, {"tiled_mlp_shards": 4}, True),
        (
            "AnyPrecisionAdamW bf16 + Kahan",
            "d1",
            1,
            {},
            {"param_dtype": "bfloat16", "optimizer": {"name": "anyprecision_adamw"}},
            True,
        ),
        ("FSDP 2 CPU offload", "d2", 2, {}, {"cpu_offload": True}, False),
        ("offload_when_idle", "d1", 1, {}, {"offload_when_idle": True}, False),
    ]
    lora = {"r": 8, "alpha": 16, "target_modules": ALL_LINEARS}
    cases.insert(3, ("LoRA r=8, all projections", "d1", 1, {}, {"lora": lora}, True))
    return cases


def _measure(layout: str, world: int, options: dict[str, Any]) -> int:
    from shardforge.algorithms.plan.measure import measure_on_ranks

    per_rank = measure_on_ranks(
        MODEL, layout, world, seq_len=SEQ_LEN, micro_batch_tokens=TOKENS, engine_options=options, timeout_s=900
    )
    return max(int(r["peak_bytes"]) for r in per_rank)


def _predict(layout: str, world: int, options: dict[str, Any]) -> float | None:
    """Planner prediction in bytes, or None where it does not model an option."""
    from shardforge.algorithms.plan.measure import predict_engine_peak

    try:
        est = predict_engine_peak(
            MODEL, layout, world, seq_len=SEQ_LEN, micro_batch_tokens=TOKENS, engine_options=options
        )
    except (ValueError, TypeError) as err:
        print(f"[{NAME}]   planner: {err}", flush=True)
        return None
    return float(est.total)


def _mib(value: float | None) -> float | None:
    return None if value is None else value / 2**20


def plot(rows: list[dict[str, Any]], png: Path) -> None:
    plt = _common.pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.8))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["off_mib"] for r in rows], width=0.4, label="feature off", color="#c44e52")
    ax.bar([x + 0.2 for x in xs], [r["on_mib"] for r in rows], width=0.4, label="feature on", color="#55a868")
    for x, r in zip(xs, rows, strict=True):
        for dx, key in ((-0.2, "off_pred_mib"), (0.2, "on_pred_mib")):
            if r.get(key) is not None:
                ax.plot([x + dx - 0.18, x + dx + 0.18], [r[key]] * 2, color="black", lw=2)
        if not r["measurable_on_cpu"]:
            ax.annotate("host = device on CPU", (x, r["on_mib"]), ha="center", fontsize=7, xytext=(0, 4),
                        textcoords="offset points")  # fmt: skip
    ax.plot([], [], color="black", lw=2, label="planner prediction")
    ax.set_xticks(list(xs), [r["feature"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("peak MiB per rank, one train_batch")
    ax.set_title("memory features off vs on (Qwen3 h256 x 4 layers, 4096 tokens/rank, measured on CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    from shardforge.mesh.testing import get_rank_pool

    started = time.perf_counter()
    info = _common.machine_info()
    rows: list[dict[str, Any]] = []
    for feature, layout, world, off, on, measurable in _cases():
        t0 = time.perf_counter()
        measured_off, measured_on = _measure(layout, world, off), _measure(layout, world, on)
        row = {
            "feature": feature,
            "layout": layout,
            "world_size": world,
            "off_mib": measured_off / 2**20,
            "on_mib": measured_on / 2**20,
            "on_over_off": measured_on / measured_off,
            "off_pred_mib": _mib(_predict(layout, world, off)),
            "on_pred_mib": _mib(_predict(layout, world, on)),
            "measurable_on_cpu": measurable,
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        pred = (
            f"predicted {row['off_pred_mib']:.1f} -> {row['on_pred_mib']:.1f} MiB"
            if row["off_pred_mib"] is not None and row["on_pred_mib"] is not None
            else "predicted: n/a"
        )
        print(
            f"[{NAME}] {feature:34s} measured {row['off_mib']:7.1f} -> {row['on_mib']:7.1f} MiB "
            f"(x{row['on_over_off']:.3f}); {pred}{'' if measurable else '  [host = device on CPU]'}",
            flush=True,
        )
    get_rank_pool(2).close()
    result = {
        "benchmark": NAME,
        "description": "peak bytes per rank of one train_batch with each memory feature off vs on",
        "model": MODEL,
        "seq_len": SEQ_LEN,
        "tokens_per_rank": TOKENS,
        "rows": rows,
        "machine": info,
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    _common.write_json(NAME, result)
    plot(rows, _common.png_path(NAME))
    cpu_rows = [r for r in rows if r["measurable_on_cpu"]]
    _common.upsert_result_row(
        benchmark=f"{NAME} (off vs on)",
        metric="peak MiB per rank of one train_batch (storage-tracked, Qwen3 h256 x 4, 4096 tokens): "
        + "; ".join(f"{r['feature']}" for r in cpu_rows),
        ours=", ".join(f"{r['on_mib']:.0f}" for r in cpu_rows),
        baseline=", ".join(f"{r['off_mib']:.0f}" for r in cpu_rows),
        ratio=", ".join(f"{r['on_over_off']:.2f}x" for r in cpu_rows),
        target="each feature lowers the peak (ratio < 1)",
        machine=_common.machine_label(info),
    )
    print(f"[{NAME}] done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
