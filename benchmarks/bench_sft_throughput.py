"""SFT throughput: packed FSDP on 2 ranks (`TrainEngine` "d2") vs a plain padded PyTorch loop.

Both sides train the same Qwen3 config from the same initial weights on the same global
batches (same sequences per optimizer step, same number of steps), on the same 2 cores:

* ours: a 2-rank gloo pool, one thread per rank; each rank packs its strided share of the
  global batch (``batch[dp_rank::dp_size]``, as the SFT trainer does) with
  `pack_sequences` and calls ``engine.train_batch`` (packed attention, FSDP2, AdamW,
  grad clipping 1.0);
* baseline: one process with ``torch.set_num_threads(2)``, the HF model with SDPA
  attention, right-padded batches to the longest sequence of the batch with an
  ``attention_mask`` and ``labels`` (-100 on padding and prompts), ``torch.optim.AdamW``
  with the same hyper-parameters and the same clipping.

Throughput is real (non-pad) tokens per second of wall time over the timed steps, whether
a token is a training target or not; the first ``WARMUP`` steps are excluded. The data
mixes the demo's addition prompts + answers (~10 tokens) with random sequences whose
lengths are spread uniformly over 8..256, so padding to the longest one costs something.

Run: ``python benchmarks/bench_sft_throughput.py`` from the repo root (a few minutes); with
``--strict`` it exits 1 when the target is missed (by default it only reports).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

NAME = "sft_throughput"
TARGET = 1.3
WORLD = 2
GLOBAL_BATCH = 32
WARMUP = 2
TIMED = 8
LONG_FRACTION = 0.5
LONG_LENGTHS = (8, 256)
SEED = 0
MODEL = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}
LR = 1e-4
MAX_GRAD_NORM = 1.0


# ---------------------------------------------------------------------- data
def make_batches() -> tuple[list[list[tuple[list[int], list[float]]]], dict[str, Any]]:
    """WARMUP + TIMED global batches of (ids, loss mask); and a summary of the lengths."""
    import json
    import random

    from shardforge.algorithms.data import tokenize_sft_row
    from shardforge.algorithms.demo import build_char_tokenizer, make_addition_data

    rng = random.Random(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_char_tokenizer(Path(tmp) / "tokenizer")
        train, _ = make_addition_data(Path(tmp) / "data", seed=SEED)
        rows = [json.loads(line) for line in train.read_text().splitlines() if line.strip()]
    addition = [tokenize_sft_row(row, tokenizer) for row in rows]
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(MODEL["vocab_size"]) if i not in special]
    batches = []
    for _ in range(WARMUP + TIMED):
        batch = []
        for _ in range(GLOBAL_BATCH):
            if rng.random() < LONG_FRACTION:
                length = rng.randint(*LONG_LENGTHS)
                ids = [tokenizer.bos_token_id] + [rng.choice(vocab) for _ in range(length - 1)]
                batch.append((ids, [1.0] * length))  # all targets (pack_sequences zeroes the first)
            else:
                example = addition[rng.randrange(len(addition))]
                batch.append((list(example.input_ids), list(example.loss_mask)))
        batches.append(batch)
    lengths = [len(ids) for batch in batches for ids, _ in batch]
    padded = [GLOBAL_BATCH * max(len(ids) for ids, _ in batch) for batch in batches]
    summary = {
        "sequences": len(lengths),
        "min_len": min(lengths),
        "max_len": max(lengths),
        "mean_len": sum(lengths) / len(lengths),
        "real_tokens": sum(lengths),
        "padded_tokens_baseline": sum(padded),
        "padding_efficiency_baseline": sum(lengths) / sum(padded),
        "addition_example_len": sum(len(e.input_ids) for e in addition) / len(addition),
    }
    return batches, summary


# ---------------------------------------------------------------------- ours
def run_ours(batches: list[list[tuple[list[int], list[float]]]]) -> dict[str, Any]:
    """On each rank of the pool: packed FSDP training with `TrainEngine` (one thread per rank)."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config

    from shardforge.algorithms import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences

    torch.set_num_threads(1)
    config = EngineConfig(optimizer=OptimizerConfig(lr=LR, max_grad_norm=MAX_GRAD_NORM), seed=SEED)
    engine = TrainEngine(Qwen3Config(**MODEL), f"d{WORLD}", config)
    losses, step_times, tokens = [], [], 0.0
    start = 0.0
    for step, batch in enumerate(batches):
        if step == WARMUP:
            dist.barrier()
            start = time.perf_counter()
        mine = batch[engine.dp_rank :: engine.dp_size]
        stats = engine.train_batch(pack_sequences([ids for ids, _ in mine], [mask for _, mask in mine]))
        losses.append(stats["loss"])
        step_times.append(stats["step_time_s"])
        if step >= WARMUP:
            tokens += stats["tokens"]  # real tokens of the global batch (summed over ranks)
    dist.barrier()
    elapsed = time.perf_counter() - start
    return {
        "rank": dist.get_rank(),
        "threads": torch.get_num_threads(),
        "timed_seconds": elapsed,
        "timed_tokens": tokens,
        "losses": losses,
        "step_times_s": step_times,
    }


# ---------------------------------------------------------------------- baseline
def run_baseline(batches: list[list[tuple[list[int], list[float]]]]) -> dict[str, Any]:
    """Single process, 2 threads: HF model + padded batches + attention_mask + AdamW."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.set_num_threads(WORLD)
    torch.manual_seed(SEED)  # the engine initialises from the config with the same seed
    model = AutoModelForCausalLM.from_config(Qwen3Config(**MODEL), attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    pad_id = 0
    losses, step_times, tokens, padded_tokens = [], [], 0, 0
    start = 0.0
    for step, batch in enumerate(batches):
        if step == WARMUP:
            start = time.perf_counter()
        t0 = time.perf_counter()
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            n = len(ids)
            input_ids[row, :n] = torch.tensor(ids)
            attention_mask[row, :n] = 1
            target = torch.tensor(mask) > 0
            target[0] = False  # the first token is never a target (as in pack_sequences)
            labels[row, :n] = torch.where(target, torch.tensor(ids), torch.tensor(-100))
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.loss))
        step_times.append(time.perf_counter() - t0)
        if step >= WARMUP:
            tokens += int(attention_mask.sum())
            padded_tokens += attention_mask.numel()
    elapsed = time.perf_counter() - start
    return {
        "threads": torch.get_num_threads(),
        "timed_seconds": elapsed,
        "timed_tokens": tokens,
        "timed_padded_tokens": padded_tokens,
        "losses": losses,
        "step_times_s": step_times,
    }


# ---------------------------------------------------------------------- report
def plot(result: dict[str, Any], png: Path) -> None:
    plt = _common.pyplot()
    ours, base = result["ours"], result["baseline"]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"packed FSDP\n{WORLD} ranks x 1 thread", f"padded plain PyTorch\n1 process x {WORLD} threads"]
    values = [ours["tokens_per_s"], base["tokens_per_s"]]
    bars = ax0.bar(labels, values, color=["#4c72b0", "#999999"])
    for bar, value in zip(bars, values):
        ax0.text(bar.get_x() + bar.get_width() / 2, value, f"{value:,.0f}", ha="center", va="bottom")
    ax0.set_ylabel("real (non-pad) tokens / s")
    met = "met" if result["met"] else "MISSED"
    ax0.set_title(f"SFT throughput: {result['ratio']:.2f}x (target >= {TARGET:.1f}x, {met})")
    steps = list(range(1, len(ours["losses"]) + 1))
    ax1.plot(steps, ours["losses"], "o-", label="packed FSDP (TrainEngine d2)")
    ax1.plot(steps, base["losses"], "x--", label="padded baseline")
    ax1.axvspan(0.5, WARMUP + 0.5, color="#eeeeee", label="warmup (not timed)")
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("loss (nats / target token)")
    ax1.set_title("same data, same init: losses should match")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    from shardforge.mesh.testing.pool import get_rank_pool

    started = time.perf_counter()
    info = _common.machine_info()
    batches, data = make_batches()
    print(
        f"[{NAME}] {len(batches)} global batches of {GLOBAL_BATCH} sequences ({WARMUP} warmup + {TIMED} timed); "
        f"lengths {data['min_len']}..{data['max_len']} (mean {data['mean_len']:.1f}); padding to the longest "
        f"wastes {1 - data['padding_efficiency_baseline']:.0%} of the baseline's tokens",
        flush=True,
    )
    pool = get_rank_pool(WORLD)
    per_rank = pool.run(run_ours, batches, timeout_s=600)
    pool.close()  # no idle workers next to the baseline
    seconds = max(r["timed_seconds"] for r in per_rank)
    ours = {
        "tokens_per_s": per_rank[0]["timed_tokens"] / seconds,
        "timed_seconds": seconds,
        "timed_tokens": per_rank[0]["timed_tokens"],
        "losses": per_rank[0]["losses"],
        "step_times_s": per_rank[0]["step_times_s"],
        "per_rank": per_rank,
    }
    print(f"[{NAME}] ours: {ours['tokens_per_s']:,.0f} tokens/s ({seconds:.1f} s timed)", flush=True)
    base = run_baseline(batches)
    base["tokens_per_s"] = base["timed_tokens"] / base["timed_seconds"]
    print(f"[{NAME}] baseline: {base['tokens_per_s']:,.0f} tokens/s ({base['timed_seconds']:.1f} s timed)", flush=True)
    if base["timed_tokens"] != ours["timed_tokens"]:
        raise RuntimeError(f"token counts differ: ours {ours['timed_tokens']} vs baseline {base['timed_tokens']}")
    ratio = ours["tokens_per_s"] / base["tokens_per_s"]
    max_loss_gap = max(abs(a - b) for a, b in zip(ours["losses"], base["losses"]))
    result = {
        "benchmark": NAME,
        "description": "real (non-pad) tokens/s: packed FSDP d2 (2 ranks x 1 thread) vs padded plain loop (1 x 2 threads)",
        "target_min_ratio": TARGET,
        "ratio": ratio,
        "met": ratio >= TARGET,
        "model": MODEL,
        "global_batch_sequences": GLOBAL_BATCH,
        "warmup_steps": WARMUP,
        "timed_steps": TIMED,
        "data": data,
        "max_abs_loss_gap": max_loss_gap,
        "ours": ours,
        "baseline": base,
        "machine": info,
        "date": _common.today(),
    }
    png = _common.png_path(NAME)
    plot(result, png)
    result["seconds"] = time.perf_counter() - started
    json_path = _common.write_json(NAME, result)
    _common.upsert_result_row(
        benchmark=NAME,
        metric=f"SFT real tokens/s, packed FSDP d2 vs padded 1-process loop ({WORLD} cores)",
        ours=f"{ours['tokens_per_s']:,.0f}",
        baseline=f"{base['tokens_per_s']:,.0f}",
        ratio=f"{ratio:.2f}",
        target=_common.target_cell(f">= {TARGET:.2f}", result["met"]),
        machine=_common.machine_label(info),
    )
    print(
        f"[{NAME}] ratio {ratio:.2f}x (target >= {TARGET:.1f}x: {'met' if result['met'] else 'MISSED'}); "
        f"max |loss gap| over steps {max_loss_gap:.2e}",
        flush=True,
    )
    print(f"[{NAME}] wrote {json_path}, {png} and its row in {_common.RESULTS_MD}", flush=True)
    print(f"[{NAME}] done in {result['seconds']:.0f} s", flush=True)
    return 1 if not result["met"] and "--strict" in sys.argv[1:] else 0


if __name__ == "__main__":
    sys.exit(main())
