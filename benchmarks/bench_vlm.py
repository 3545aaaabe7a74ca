"""Vision-language models (Qwen2.5-VL): packed vs padded throughput, frozen vs trained vision tower memory,
and the planner's prediction for VLM layouts vs the measurement.

(a) **Packed vs padded.** The same image+text samples (half the rows with 8-32 text tokens, a short question,
    half with 64-768, a long document; 0-3 images of 1-36 image tokens each, 4-144 patches) train the same Qwen2.5-VL from the same weights with the same
    AdamW (lr 1e-4, clip 1.0), one process, one thread each side, in rounds that alternate which side goes
    first:

    * ours: `TrainEngine` at world 1 on `pack_vlm_examples` batches (one packed sequence per micro-batch,
      per-sequence 3-D mRoPE positions, the vision tower over every image of the micro-batch);
    * baseline: plain transformers, the model with SDPA attention, right-padded batches to the longest row
      with ``attention_mask``, ``labels`` (-100 off the assistant tokens), all images of the batch in
      ``pixel_values`` / ``image_grid_thw`` and ``mm_token_type_ids`` (so HF computes the 3-D positions),
      ``torch.optim.AdamW``.

    Metric: real (non-pad) tokens per second of wall time over the timed steps. Target >= 1.3x.

(b) **Frozen vs trained vision tower.** Peak bytes of one steady-state ``train_batch`` at world 1 with
    ``engine.freeze_module_prefix: [model.visual]`` vs training everything, counted with the storage
    tracker every CPU memory benchmark uses (`shardforge.algorithms.plan.measure`). Target: ratio < 1.

(c) **Planner vs measured.** `shardforge.algorithms.plan.vision_measure.predict_vlm_peak` (the planner's memory
    model with the vision tower counted: its params sharded over fsdp, trained or frozen, its saved
    activations per patch) vs the same storage-tracked measurement, for d1 and FSDP d2 with the vision
    tower trained and frozen. Target: predicted / measured within 1 +- 0.15 for every row.

Run: ``python benchmarks/bench_vlm.py`` from the repo root (~10 min on 2 loaded cores); ``--strict`` exits 1
when a target is missed; ``--quick`` runs fewer steps (a smoke run; it writes no RESULTS.md rows).
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "vlm"
TARGET_SPEEDUP = 1.3
TOLERANCE = 0.15
HIDDEN, LAYERS, VISION_DEPTH = 128, 4, 4
NUM_ROWS, BATCH = 96, 16
WARMUP, TIMED = 1, 4  # batches; each timed batch is one alternated round
LR, MAX_GRAD_NORM, SEED = 1e-4, 1.0, 0
SHORT_TEXT, LONG_TEXT = (8, 32), (64, 768)  # user text tokens: half the rows short (VQA-like), half long
IMAGE_SIDES = (28, 56, 84, 112, 140, 168)  # pixels (patch 14, merge 2): 1 .. 36 image tokens per image
# (c): sequences of PLAN_SEQ tokens with one PLAN_GRID x PLAN_GRID-patch image each, PLAN_TOKENS per rank.
PLAN_SEQ, PLAN_TOKENS, PLAN_GRID = 256, 1024, 16
PLAN_CASES = [  # (label, layout, world, frozen prefixes)
    ("1 rank, vision trained", "d1", 1, ()),
    ("1 rank, vision frozen", "d1", 1, ("model.visual",)),
    ("FSDP 2, vision trained", "d2", 2, ()),
    ("FSDP 2, vision frozen", "d2", 2, ("model.visual",)),
]


def build_assets(root: Path) -> dict[str, Any]:
    """The benchmark's Qwen2.5-VL (hidden 128, 4 text layers, 4 vision blocks) and image processor."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from shardforge.algorithms.testing.vlm import build_vlm_tokenizer, tiny_qwen2_5_vl_config

    tokenizer = build_vlm_tokenizer()
    processor = Qwen2VLImageProcessorPil(patch_size=14, min_pixels=28 * 28, max_pixels=28 * 28 * 64)
    config = tiny_qwen2_5_vl_config(tokenizer, hidden=HIDDEN, layers=LAYERS, vision_depth=VISION_DEPTH)
    torch.manual_seed(SEED)
    model_dir = root / "model"
    AutoModelForImageTextToText.from_config(config).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    processor.save_pretrained(str(model_dir))
    return {"model": str(model_dir), "tokenizer": tokenizer, "processor": processor, "config": config}


def make_examples(root: Path, tokenizer: Any, processor: Any) -> list[Any]:
    """``NUM_ROWS`` chat rows: random user text, half the rows of a length uniform over ``SHORT_TEXT`` (a short
    question about the images), half over ``LONG_TEXT`` (a long document), 0-3 images of random sides in
    ``IMAGE_SIDES`` (random pixels), a 4-32 character assistant answer (the loss)."""
    from PIL import Image

    from shardforge.algorithms.data.vlm import tokenize_vlm_row

    rng = random.Random(SEED)
    letters = "abcdefghijklmnopqrstuvwxyz "
    (root / "images").mkdir(parents=True, exist_ok=True)
    examples = []
    for i in range(NUM_ROWS):
        parts: list[dict[str, str]] = []
        for j in range(rng.choice((0, 1, 1, 2, 3))):
            w, h = rng.choice(IMAGE_SIDES), rng.choice(IMAGE_SIDES)
            path = root / "images" / f"{i}_{j}.png"
            Image.frombytes("RGB", (w, h), bytes(rng.randrange(256) for _ in range(w * h * 3))).save(path)
            parts.append({"type": "image", "image": str(path)})
        text = "".join(rng.choice(letters) for _ in range(rng.randint(*(SHORT_TEXT if i % 2 else LONG_TEXT))))
        parts.append({"type": "text", "text": text})
        answer = "".join(rng.choice(letters) for _ in range(rng.randint(4, 32)))
        row = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}
        examples.append(tokenize_vlm_row(row, tokenizer, processor, image_token="<|image_pad|>", where=f"row {i}"))
    return examples


class Ours:
    """`TrainEngine` at world 1 (one thread) on packed batches."""

    def __init__(self, model_dir: str) -> None:
        from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

        config = EngineConfig(
            optimizer=OptimizerConfig(lr=LR, max_grad_norm=MAX_GRAD_NORM), max_tokens_per_microbatch=1 << 16
        )
        self.engine = TrainEngine(model_dir, "d1", config)

    def steps(self, examples: list[Any], batches: list[list[int]]) -> dict[str, Any]:
        import torch

        from shardforge.algorithms.data.vlm import pack_vlm_examples

        torch.set_num_threads(1)
        losses, tokens = [], 0
        start = time.perf_counter()
        for indices in batches:
            stats = self.engine.train_batch(pack_vlm_examples(examples, indices))
            losses.append(stats["loss"])
            tokens += sum(len(examples[i].input_ids) for i in indices)
        return {"seconds": time.perf_counter() - start, "tokens": tokens, "padded_tokens": tokens, "losses": losses}


class Padded:
    """Plain transformers: right-padded batches, attention_mask, labels, all the batch's images, AdamW."""

    def __init__(self, model_dir: str, config: Any) -> None:
        import torch
        from transformers import AutoModelForImageTextToText

        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa")
        self.model.config.use_cache = False
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8)
        self.pad_id = int(config.text_config.pad_token_id)
        self.image_id = int(config.image_token_id)

    def collate(self, examples: list[Any], indices: list[int]) -> dict[str, Any]:
        import torch

        chosen = [examples[i] for i in indices]
        width = max(len(e.input_ids) for e in chosen)
        ids = torch.full((len(chosen), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chosen), width), dtype=torch.long)
        labels = torch.full((len(chosen), width), -100, dtype=torch.long)
        for row, e in enumerate(chosen):
            n = len(e.input_ids)
            ids[row, :n] = torch.tensor(e.input_ids)
            mask[row, :n] = 1
            target = torch.tensor(e.loss_mask) > 0
            target[0] = False
            labels[row, :n] = torch.where(target, ids[row, :n], -100)
        inputs = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "mm_token_type_ids": (ids == self.image_id).long(),
        }
        pixels = [e.pixel_values for e in chosen if e.image_grid_thw.numel()]
        if pixels:
            inputs["pixel_values"] = torch.cat(pixels)
            inputs["image_grid_thw"] = torch.cat([e.image_grid_thw for e in chosen if e.image_grid_thw.numel()])
        return inputs

    def steps(self, examples: list[Any], batches: list[list[int]]) -> dict[str, Any]:
        import torch

        torch.set_num_threads(1)
        self.model.train()
        losses, tokens, padded = [], 0, 0
        start = time.perf_counter()
        for indices in batches:
            inputs = self.collate(examples, indices)
            out = self.model(**inputs, use_cache=False)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
            tokens += int(inputs["attention_mask"].sum())
            padded += inputs["attention_mask"].numel()
        return {"seconds": time.perf_counter() - start, "tokens": tokens, "padded_tokens": padded, "losses": losses}


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: sum(p[k] for p in parts) for k in ("seconds", "tokens", "padded_tokens")}
    out["losses"] = [x for p in parts for x in p["losses"]]
    out["tokens_per_s"] = out["tokens"] / out["seconds"]
    out["round_tokens_per_s"] = [p["tokens"] / p["seconds"] for p in parts]
    return out


def throughput(assets: dict[str, Any], examples: list[Any], timed: int) -> dict[str, Any]:
    rng = random.Random(SEED + 1)
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches = [order[i : i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)][: WARMUP + timed]
    ours, base = Ours(assets["model"]), Padded(assets["model"], assets["config"])
    first = {"ours": ours.steps(examples, batches[:WARMUP]), "padded": base.steps(examples, batches[:WARMUP])}
    ours_parts, base_parts, loads = [], [], []
    for n, indices in enumerate(batches[WARMUP:]):
        loads.append(_load())
        if n % 2 == 0:
            ours_parts.append(ours.steps(examples, [indices]))
            base_parts.append(base.steps(examples, [indices]))
        else:
            base_parts.append(base.steps(examples, [indices]))
            ours_parts.append(ours.steps(examples, [indices]))
        print(f"[{NAME}] round {n}: ours {ours_parts[-1]['tokens'] / ours_parts[-1]['seconds']:.0f} tok/s, padded "
              f"{base_parts[-1]['tokens'] / base_parts[-1]['seconds']:.0f} tok/s (load {loads[-1]})", flush=True)  # fmt: skip
    o, b = _merge(ours_parts), _merge(base_parts)
    images = [int(examples[i].image_grid_thw.shape[0]) for bt in batches for i in bt]
    return {
        "ours": o,
        "padded": b,
        "speedup": o["tokens_per_s"] / b["tokens_per_s"],
        "round_speedups": [x / y for x, y in zip(o["round_tokens_per_s"], b["round_tokens_per_s"])],
        "first_loss_gap": abs(first["ours"]["losses"][0] - first["padded"]["losses"][0]),
        "padding_efficiency": b["tokens"] / b["padded_tokens"],
        "images_per_row": {str(k): images.count(k) for k in sorted(set(images))},
        "row_tokens": [len(e.input_ids) for e in examples],
        "load": loads,
    }


def frozen_vs_trained(assets: dict[str, Any], examples: list[Any]) -> dict[str, Any]:
    from shardforge.algorithms.plan.vision_measure import measure_vlm_peak

    batch = list(range(BATCH))
    out = {}
    for label, frozen in (("trained", ()), ("frozen", ("model.visual",))):
        out[label] = measure_vlm_peak(assets["model"], examples, batch, freeze=frozen)
        print(f"[{NAME}] vision tower {label}: peak {out[label]['peak_bytes'] / 2**20:.2f} MiB", flush=True)
    out["ratio"] = out["frozen"]["peak_bytes"] / out["trained"]["peak_bytes"]
    return out


def planner_rows(assets: dict[str, Any]) -> list[dict[str, Any]]:
    from shardforge.algorithms.plan.vision_measure import measure_vlm_on_ranks, predict_vlm_peak

    rows = []
    for label, layout, world, frozen in PLAN_CASES:
        spec = {"seq_len": PLAN_SEQ, "tokens": PLAN_TOKENS, "grid": PLAN_GRID}
        per_rank = measure_vlm_on_ranks(assets["model"], layout, world, spec, frozen)
        est = predict_vlm_peak(
            assets["config"], layout, world, seq_len=PLAN_SEQ, micro_batch_tokens=PLAN_TOKENS,
            vision_patches=PLAN_TOKENS // PLAN_SEQ * PLAN_GRID * PLAN_GRID, frozen=frozen,
        )  # fmt: skip
        measured = max(r["peak_bytes"] for r in per_rank)
        row = {
            "label": label,
            "layout": layout,
            "frozen": list(frozen),
            "measured_mib": measured / 2**20,
            "predicted_mib": est.total / 2**20,
            "ratio": est.total / measured,
            "phase": est.phase,
            "predicted": est.as_dict(),
            "measured_per_rank": per_rank,
        }
        row["met"] = abs(row["ratio"] - 1) <= TOLERANCE
        rows.append(row)
        print(f"[{NAME}] planner {label:24s} measured {row['measured_mib']:7.2f} MiB predicted "
              f"{row['predicted_mib']:7.2f} MiB ratio {row['ratio']:.3f} (peak at {est.phase})", flush=True)  # fmt: skip
    return rows


def _load() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def plot(result: dict[str, Any], png: Path) -> None:
    plt = _common.pyplot()
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(15, 4.5))
    t = result["throughput"]
    ax.bar(["packed (engine)", "padded (HF)"], [t["ours"]["tokens_per_s"], t["padded"]["tokens_per_s"]],
           color=["#4c72b0", "#dd8452"])  # fmt: skip
    ax.set_ylabel("real tokens/s (1 thread)")
    ax.set_title(f"packed vs padded: {t['speedup']:.2f}x")
    m = result["memory"]
    bx.bar(["vision trained", "vision frozen"], [m["trained"]["peak_bytes"] / 2**20, m["frozen"]["peak_bytes"] / 2**20],
           color=["#55a868", "#8172b2"])  # fmt: skip
    bx.set_ylabel("peak MiB (storage-tracked)")
    bx.set_title(f"frozen / trained vision tower: {m['ratio']:.3f}")
    rows = result["planner"]
    xs = range(len(rows))
    cx.bar([x - 0.2 for x in xs], [r["measured_mib"] for r in rows], width=0.4, label="measured", color="#55a868")
    cx.bar([x + 0.2 for x in xs], [r["predicted_mib"] for r in rows], width=0.4, label="predicted", color="#4c72b0")
    cx.set_xticks(list(xs), [r["label"] for r in rows], rotation=30, ha="right", fontsize=7)
    cx.set_ylabel("peak MiB per rank")
    cx.set_title("planner vs measured (Qwen2.5-VL)")
    cx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    import torch

    from shardforge.mesh.testing import get_rank_pool

    quick = "--quick" in sys.argv[1:]
    torch.set_num_threads(1)
    started = time.perf_counter()
    info = _common.machine_info()
    load_before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        assets = build_assets(Path(tmp))
        examples = make_examples(Path(tmp), assets["tokenizer"], assets["processor"])
        speed = throughput(assets, examples, 2 if quick else TIMED)
        memory = frozen_vs_trained(assets, examples)
        rows = planner_rows(assets)
        get_rank_pool(2).close()
    result = {
        "benchmark": NAME,
        "model": {"hidden": HIDDEN, "text_layers": LAYERS, "vision_depth": VISION_DEPTH, "family": "qwen2_5_vl"},
        "throughput": speed,
        "memory": memory,
        "planner": rows,
        "machine": info,
        "load_before": load_before,
        "load_after": _load(),
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    json_path = _common.write_json(NAME, result)
    png = _common.png_path(NAME)
    plot(result, png)
    met_speed = speed["speedup"] >= TARGET_SPEEDUP
    met_memory = memory["ratio"] < 1
    met_plan = all(r["met"] for r in rows)
    loads = [x for x in speed["load"] if x is not None]
    load_text = f"load {min(loads):.1f}-{max(loads):.1f}" if loads else "load unknown"
    if not quick:
        _common.upsert_result_row(
            benchmark="vlm_packed_vs_padded",
            metric=f"VLM SFT real tokens/s, packed engine vs padded HF loop, Qwen2.5-VL h{HIDDEN} x {LAYERS} + "
            f"{VISION_DEPTH} vision blocks, {BATCH} rows/step, half 8-32 and half 64-768 text tokens, 0-3 images, 1 thread each, "
            f"{TIMED} alternated rounds (padding efficiency {speed['padding_efficiency']:.2f}, first-loss gap "
            f"{speed['first_loss_gap']:.1e}, {load_text})",
            ours=f"{speed['ours']['tokens_per_s']:,.0f}",
            baseline=f"{speed['padded']['tokens_per_s']:,.0f}",
            ratio=f"{speed['speedup']:.2f} (rounds {min(speed['round_speedups']):.2f}-{max(speed['round_speedups']):.2f})",
            target=_common.target_cell(f">= {TARGET_SPEEDUP}x", met_speed),
            machine=_common.machine_label(info),
        )
        _common.upsert_result_row(
            benchmark="vlm_frozen_vision_memory",
            metric=f"peak MiB of one train_batch at world 1 (storage-tracked), vision tower frozen vs trained, "
            f"{BATCH} rows",
            ours=f"{memory['frozen']['peak_bytes'] / 2**20:.2f}",
            baseline=f"{memory['trained']['peak_bytes'] / 2**20:.2f}",
            ratio=f"{memory['ratio']:.3f}",
            target=_common.target_cell("< 1", met_memory),
            machine=_common.machine_label(info),
        )
        ratios = [r["ratio"] for r in rows]
        worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
        _common.upsert_result_row(
            benchmark="vlm_planner (predicted vs measured)",
            metric=f"per-rank peak MiB of one train_batch, Qwen2.5-VL, {len(rows)} cases (d1/d2 x vision trained/"
            f"frozen), {PLAN_TOKENS} tokens/rank with {PLAN_TOKENS // PLAN_SEQ} images of {PLAN_GRID}x{PLAN_GRID} "
            "patches; ratio range [worst]",
            ours=f"{min(ratios):.3f} .. {max(ratios):.3f}",
            baseline="1.00 (measured)",
            ratio=f"{worst['ratio']:.3f} [{worst['label']}]",
            target=_common.target_cell(f"within 1 +- {TOLERANCE:.2f}", met_plan),
            machine=_common.machine_label(info),
        )
    print(f"[{NAME}] speedup {speed['speedup']:.2f}x, frozen/trained memory {memory['ratio']:.3f}, planner ratios "
          f"{[round(r['ratio'], 3) for r in rows]}; wrote {json_path}, {png}; {time.perf_counter() - started:.0f} s")  # fmt: skip
    return 1 if "--strict" in sys.argv[1:] and not (met_speed and met_memory and met_plan) else 0


if __name__ == "__main__":
    sys.exit(main())
