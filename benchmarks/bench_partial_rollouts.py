"""Partial (interruptible) rollouts: trainer idle fraction and steps/hour with long-tailed responses.

The real `AsyncRollouts` / `SyncRollouts` sources drive a simulated rollout engine and a simulated
trainer (no model): the trainer's step sleeps ``TRAIN_S``; generation sleeps in proportion to the
tokens decoded. Response lengths are heavy-tailed (Pareto, alpha 1.3, 8 tokens minimum, capped at
``MAX_NEW``), the same per batch in every mode (seeded by the batch index). Modes:

- ``sync``: generate batch k after step k - 1 (the trainer idles while it generates);
- ``async``: ``async_rollouts`` with ``max_staleness=1``, one ``generate`` call per batch;
- ``partial``: the same plus ``rollout.partial_rollouts`` (chunks of ``CHUNK`` tokens; between chunks the
  generator loads newer weights, and rows that finished leave the batch).

Two cost models of a decode step, one results row each:

- ``rows`` (the embedded HF engine on CPU): a step costs per row in the batch, and HF ``generate`` keeps
  decoding (padding) finished rows until the longest response ends; chunked generation drops them at the
  next chunk boundary. This is where partial rollouts gain here;
- ``steps`` (an accelerator, where a decode step costs about the same for 1 or 32 rows): a batch costs
  its longest response either way, and the per-batch schedule (batch k starts with policy k - s)
  does not change, so partial rollouts buy fresher tokens, not trainer time.

Idle fraction = time the trainer waited for rollouts / wall time; steps/hour from the wall time.

Run: ``python benchmarks/bench_partial_rollouts.py`` from the repo root (about 1 minute).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "partial_rollouts"
STEPS, ROWS, MAX_NEW, CHUNK = 24, 32, 512, 16
TRAIN_S = 0.25
# Seconds per decoded token: per row-token (rows) or per decode step (steps); both make the mean
# unchunked batch take about 1.6x a training step, so the asynchronous trainer waits.
UNIT_S = {"rows": 0.4 / (ROWS * 220), "steps": 0.4 / 220}


def lengths(index: int) -> list[int]:
    rng = random.Random(1000 + index)
    return [min(MAX_NEW, int(8 * rng.paretovariate(1.3))) for _ in range(ROWS)]


class SimulatedEngine:
    """Rollout engine stand-in: sleeps for the decode work; chunked when built with ``chunks`` (partial rollouts)."""

    def __init__(self, cost: str, chunks: Any = None) -> None:
        self.version, self.cost, self.chunks = 0, cost, chunks
        self.switches, self.generating = 0, False

    def update_weights(self, version: int | None = None) -> int:
        self.switches += self.generating and version is not None and version != self.version
        self.version = self.version if version is None else version
        return self.version

    def _decode(self, active_rows: int, steps: int) -> None:
        time.sleep(UNIT_S[self.cost] * steps * (active_rows if self.cost == "rows" else 1))

    def sample(self, index: int) -> tuple[list[Any], Any]:
        import torch

        todo = lengths(index)
        self.generating = True
        if self.chunks is None:
            self._decode(len(todo), max(todo))  # one generate call: every row runs to the longest
        else:
            done = 0
            while True:
                active = [n for n in todo if n > done]
                self._decode(len(active), min(self.chunks.chunk_tokens, max(active) - done))
                done += self.chunks.chunk_tokens
                if not any(n > done for n in todo):
                    break
                self.chunks.between_chunks()
        self.generating = False
        return [], torch.zeros(len(todo))


def run(mode: str, cost: str) -> dict[str, float]:
    from shardforge.algorithms.trainers.rl.sources import AsyncRollouts, SyncRollouts
    from shardforge.rollout.chunked import ChunkedGeneration

    engine = SimulatedEngine(cost, ChunkedGeneration(CHUNK) if mode == "partial" else None)
    published = [0]

    def publish(version: int | None) -> int:
        published.append(published[-1] + 1 if version is None else version)
        return published[-1]

    if mode == "sync":
        source: Any = SyncRollouts(engine, engine.sample, publish)  # type: ignore[arg-type]
    else:
        source = AsyncRollouts(
            rollout=engine, sample_fn=engine.sample, publish_fn=publish, max_staleness=1,  # type: ignore[arg-type]
            num_batches=STEPS, start=0, dp_rank=0, dp_size=1, chunks=engine.chunks,
        )  # fmt: skip
    waited = 0.0
    started = time.perf_counter()
    for k in range(STEPS):
        before = time.perf_counter()
        if k == STEPS - 1:  # the run up to its last batch: idle without the end of the run
            before_last, waited_before_last = before - started, waited
        batch = source.batch(k)
        waited += batch.generate_s if mode == "sync" else time.perf_counter() - before
        time.sleep(TRAIN_S)  # the training step
        source.publish(k + 1)
    wall = time.perf_counter() - started
    source.close()
    return {"idle_frac": waited / wall, "steps_per_hour": STEPS / wall * 3600, "wall_s": wall,
            "idle_frac_before_last": waited_before_last / before_last,
            "mid_batch_weight_switches": float(engine.switches if mode == "partial" else 0)}  # fmt: skip


def main() -> int:
    started = time.perf_counter()
    info = _common.machine_info()
    all_lengths = [n for k in range(STEPS) for n in lengths(k)]
    results = {cost: {mode: run(mode, cost) for mode in ("sync", "async", "partial")} for cost in UNIT_S}
    payload = {
        "machine": info, "steps": STEPS, "rows": ROWS, "max_new_tokens": MAX_NEW, "chunk_tokens": CHUNK,
        "train_s": TRAIN_S, "unit_s": UNIT_S, "results": results,
        "lengths": {"mean": sum(all_lengths) / len(all_lengths), "max": max(all_lengths),
                    "batch_max_mean": sum(max(lengths(k)) for k in range(STEPS)) / STEPS},
    }  # fmt: skip
    payload["seconds"] = time.perf_counter() - started
    path = _common.write_json(NAME, payload)
    print(json.dumps(payload, indent=2))
    for cost, r in results.items():
        partial, plain, sync = r["partial"], r["async"], r["sync"]
        ratio = partial["idle_frac"] / max(plain["idle_frac"], 1e-9)
        _common.upsert_result_row(
            benchmark=f"{NAME} ({cost} cost)",
            metric=f"trainer idle fraction (steps/hour), async GRPO loop, Pareto(1.3) lengths, {cost}-proportional "
            "simulated decode",
            ours=f"partial {partial['idle_frac']:.2f} ({partial['steps_per_hour']:.0f}/h)",
            baseline=f"async {plain['idle_frac']:.2f} ({plain['steps_per_hour']:.0f}/h); "
            f"sync {sync['idle_frac']:.2f} ({sync['steps_per_hour']:.0f}/h)",
            ratio=f"idle x{ratio:.2f}",
            target=_common.target_cell("idle <= 0.5x async", ratio <= 0.5),
            machine=_common.machine_label(info),
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
