"""Streaming rollouts (issue 41) vs today's async (max_staleness=1, one generate per batch) vs sync.

The same simulated trainer (``TRAIN_S`` sleep per step), the same Pareto(1.3) response lengths and the two
decode cost models of `bench_partial_rollouts` (whose sync / async / partial rows are rerun here for an
equal-load comparison). Streaming uses the real `StreamingRollouts` with ``max_staleness=1`` and one group
per response (``prompts_per_step = ROWS``):

- ``steps`` (accelerator, continuous batching: a decode step costs the same for up to ROWS requests):
  ``ROWS`` generator workers, each request sleeps ``UNIT_S * its length`` independently;
- ``rows`` (CPU, cost per row-token): one request decodes at a time (a global lock), no padding.

Late groups (``late_groups``, `streaming_late`): the response length is a function of the prompt position here, so
a response longer than about one training step can never finish inside ``max_staleness=1`` unless the trainer waits
for it. Every position must still be trained once, so some batch waits for each such prompt's full decode. With
``defer`` (the default) a late group is released once and its prompt started again together with the other deferred
ones (after a batch's worth, or once the run's fresh prompts are all started) and waited for, so the run waits about
one longest response per batch's worth of long prompts (``last_wait_s``: in a 24-step run that wait is the last
batch's). ``regenerate`` restarts a released prompt at once: a long one is released again and again, holds a place in
flight all run, and the last batch still waits for it; ``wait`` never releases: the last batch its bound allows waits
for it, once per long prompt. ``late_groups_steps`` (JSON) compares the three on ``streaming_partial`` (steps model),
also over 72 steps (``late_groups_steps_72``). ``idle_frac_before_last`` is the idle fraction up to the last batch
(also for async/partial). The simulation charges nothing per chunk or per request (no prefill, no scheduling), as
before.

``streaming`` drives `StreamingRollouts` alone: every request keeps the weights it started with while newer ones
load for the next (an engine holding several versions at once). A real engine serves one version at a time, which
the real `StreamingSource` enforces; two more modes run it over `ChunkedGroups` (a group = one response, decoded
``CHUNK`` tokens at a time; ``steps``: ``ROWS`` workers, one group per call; ``rows``: ``ROWS`` workers too, but a
chunk decodes only under a global lock, so the total decode work equals the plain streaming row's):

- ``streaming_engine`` (no partial rollouts): a worker that needs newer weights waits until no call is in flight;
- ``streaming_partial`` (``rollout.partial_rollouts``): a publish interrupts the calls in flight at their next chunk
  boundary (all switch together, then continue under the new weights), and a call whose group was released stops
  there.

``chunk_sweep_steps`` (JSON only) reruns ``streaming_partial`` on the steps model with chunks of 4, 8 and 32 tokens.

Run: ``python benchmarks/bench_streaming.py`` from the repo root (about 3.5 minutes).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import bench_partial_rollouts as partial

NAME = "streaming_rollouts"


def run_streaming(cost: str) -> dict[str, float]:
    import torch

    from shardforge.algorithms.trainers.rl.streaming import StreamingRollouts

    rows, lock = partial.ROWS, threading.Lock()

    def group(position: int) -> tuple[list[Any], torch.Tensor]:
        n = partial.lengths(position // rows)[position % rows]
        if cost == "rows":
            with lock:
                time.sleep(partial.UNIT_S["rows"] * n)
        else:
            time.sleep(partial.UNIT_S["steps"] * n)
        return [], torch.zeros(1)

    source = StreamingRollouts(
        group_fn=group, load_weights=lambda v: None, publish_fn=lambda v: None, prompts_per_step=rows,
        max_staleness=1, num_batches=partial.STEPS, workers=rows if cost == "steps" else 1,
    )  # fmt: skip
    waited, staleness = 0.0, []
    started = time.perf_counter()
    for k in range(partial.STEPS):
        if k == partial.STEPS - 1:  # the run up to its last batch: idle without the end-of-run drain
            before_last, waited_before_last = time.perf_counter() - started, waited
        batch = source.batch(k)
        waited += batch.wait_s
        staleness.append(batch.stats["stream/staleness_mean"])
        time.sleep(partial.TRAIN_S)
        source.publish(k + 1)
    wall = time.perf_counter() - started
    source.close()
    return {"idle_frac": waited / wall, "steps_per_hour": partial.STEPS / wall * 3600, "wall_s": wall,
            "idle_frac_before_last": waited_before_last / before_last, "last_wait_s": batch.wait_s,
            "regenerated": batch.stats["stream/regenerated"], "staleness_mean": sum(staleness) / len(staleness)}  # fmt: skip


class ChunkedGroups:
    """The simulated engine of ``streaming_partial``: a group = one response, decoded ``CHUNK`` tokens at a time."""

    def __init__(self, cost: str, chunked: bool) -> None:
        from shardforge.rollout.chunked import ChunkedGeneration

        self.cost, self.version = cost, 0
        self.chunks = ChunkedGeneration(partial.CHUNK) if chunked else None
        self.lock, self.interrupted, self.stopped, self.groups_made = threading.Lock(), 0, 0, 0

    def update_weights(self, version: int | None = None) -> int:
        self.version = self.version if version is None else version
        return self.version

    def groups(self, positions: list[int]) -> list[tuple[list[Any], Any]]:
        import torch

        out = []
        for q in positions:
            n, done, seen = partial.lengths(q // partial.ROWS)[q % partial.ROWS], 0, {self.version}
            while done < n:
                step = min(partial.CHUNK, n - done)
                if self.cost == "rows":
                    with self.lock:
                        time.sleep(partial.UNIT_S["rows"] * step)
                else:
                    time.sleep(partial.UNIT_S["steps"] * step)
                done += step
                if done < n and self.chunks is not None and self.chunks.between_chunks():
                    self.stopped += 1
                    break
                seen.add(self.version)
            self.interrupted += len(seen) > 1
            self.groups_made += 1
            out.append(([], torch.zeros(1)))
        return out


def run_streaming_source(cost: str, chunked: bool, late_groups: str = "defer") -> dict[str, float]:
    """The real `StreamingSource` (one weight version per engine) over `ChunkedGroups`: with ``chunked`` (partial
    rollouts) a publish interrupts the calls in flight at their next chunk boundary; without, a worker that needs the
    new weights waits until no call is in flight."""
    from shardforge.algorithms.trainers.rl.streaming_source import StreamingSource

    engine = ChunkedGroups(cost, chunked)
    source = StreamingSource(
        rollout=engine, groups_fn=engine.groups, publish_fn=lambda v: 0 if v is None else v,  # type: ignore[arg-type]
        prompts_per_step=partial.ROWS, max_staleness=1, num_batches=partial.STEPS, start=0, dp_rank=0, dp_size=1,
        workers=partial.ROWS, chunks=engine.chunks, late_groups=late_groups,
    )  # fmt: skip
    waited, staleness = 0.0, []
    started = time.perf_counter()
    for k in range(partial.STEPS):
        if k == partial.STEPS - 1:
            before_last, waited_before_last = time.perf_counter() - started, waited
        batch = source.batch(k)
        waited += batch.wait_s
        staleness.append(batch.stats["staleness_sum"] / batch.stats["groups"])  # this rank's raw stream_stats
        time.sleep(partial.TRAIN_S)
        source.publish(k + 1)
    wall = time.perf_counter() - started
    source.close()
    return {"idle_frac": waited / wall, "steps_per_hour": partial.STEPS / wall * 3600, "wall_s": wall,
            "idle_frac_before_last": waited_before_last / before_last, "last_wait_s": batch.wait_s,
            "regenerated": batch.stats["regenerated"], "staleness_mean": sum(staleness) / len(staleness),
            "interrupted_frac": engine.interrupted / max(engine.groups_made, 1),
            "stopped_calls": float(engine.stopped)}  # fmt: skip


def _late_cell(late: dict[str, dict[str, float]]) -> str:
    """The late-group policies' idle fractions (steps model), for the results row."""
    d, w, g = late[f"defer_{partial.STEPS}"], late[f"wait_{partial.STEPS}"], late[f"regenerate_{partial.STEPS}"]
    return (
        f"late groups regenerated at once (the old behaviour) {g['idle_frac']:.2f} ({g['steps_per_hour']:.0f}/h), "
        f"waited for {w['idle_frac']:.2f} ({w['steps_per_hour']:.0f}/h), deferred in a second run {d['idle_frac']:.2f}; "
        f"72 steps: deferred {late['defer_72']['idle_frac']:.2f}, regenerated {late['regenerate_72']['idle_frac']:.2f}; "
    )


def _judge(cost: str, mode: dict[str, Any], r: dict[str, Any]) -> tuple[float, float, bool, str]:
    """A streaming mode's idle ratio vs async, steps/hour ratio vs sync, and the issue's target for ``cost``."""
    idle_ratio = mode["idle_frac"] / max(r["async"]["idle_frac"], 1e-9)
    speed = mode["steps_per_hour"] / r["sync"]["steps_per_hour"]
    if cost == "steps":
        return idle_ratio, speed, idle_ratio <= 0.5 and speed >= 1.5, "idle <= 0.5x async and steps/h >= 1.5x sync"
    met = mode["steps_per_hour"] >= r["partial"]["steps_per_hour"] * 0.97
    return idle_ratio, speed, met, "steps/h no worse than partial (3% noise)"


def main() -> int:
    started = time.perf_counter()
    info = _common.machine_info()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for cost in partial.UNIT_S:
        results[cost] = {mode: partial.run(mode, cost) for mode in ("sync", "async", "partial")}
        results[cost]["streaming"] = run_streaming(cost)
        results[cost]["streaming_engine"] = run_streaming_source(cost, chunked=False)
        results[cost]["streaming_partial"] = run_streaming_source(cost, chunked=True)
    late: dict[str, dict[str, float]] = {}  # the late-group policies on streaming_partial, steps model
    default_steps = partial.STEPS
    try:
        for steps, policies in ((default_steps, ("defer", "wait", "regenerate")), (72, ("defer", "regenerate"))):
            partial.STEPS = steps
            for policy in policies:
                late[f"{policy}_{steps}"] = run_streaming_source("steps", chunked=True, late_groups=policy)
    finally:
        partial.STEPS = default_steps
    # Sensitivity to the chunk size (steps model): the synchronised switch costs up to one chunk per worker per
    # publish. The simulation charges nothing per chunk; a real engine pays a request (vLLM) or a prefill per chunk.
    sweep, default = {}, partial.CHUNK
    try:
        for chunk in (4, 8, 32):
            partial.CHUNK = chunk
            sweep[str(chunk)] = run_streaming_source("steps", chunked=True)
    finally:
        partial.CHUNK = default
    payload = {"machine": info, "steps": partial.STEPS, "rows": partial.ROWS, "train_s": partial.TRAIN_S,
               "results": results, "chunk_sweep_steps": sweep, "late_groups_steps": late,
               "seconds": time.perf_counter() - started}  # fmt: skip
    path = _common.write_json(NAME, payload)
    print(json.dumps(payload, indent=2))
    for cost, r in results.items():
        stream, plain, part, sync = r["streaming"], r["async"], r["partial"], r["sync"]
        idle_ratio, speed, met, target = _judge(cost, stream, r)
        _common.upsert_result_row(
            benchmark=f"{NAME} ({cost} cost)",
            metric=f"trainer idle fraction (steps/hour), GRPO loop, Pareto(1.3) lengths, {cost}-proportional simulated "
            "decode, max_staleness 1, late groups deferred",
            ours=f"streaming {stream['idle_frac']:.2f} ({stream['steps_per_hour']:.0f}/h); before the last batch "
            f"{stream['idle_frac_before_last']:.2f} (async {plain['idle_frac_before_last']:.2f}), last batch waits "
            f"{stream['last_wait_s']:.2f} s",
            baseline=f"async {plain['idle_frac']:.2f} ({plain['steps_per_hour']:.0f}/h); partial "
            f"{part['idle_frac']:.2f} ({part['steps_per_hour']:.0f}/h); sync {sync['idle_frac']:.2f} "
            f"({sync['steps_per_hour']:.0f}/h)",
            ratio=f"idle x{idle_ratio:.2f}, steps/h x{speed:.2f} vs sync",
            target=_common.target_cell(target, met),
            machine=_common.machine_label(info),
        )
    for cost, r in results.items():
        sp, stream, plain, part, sync = r["streaming_partial"], r["streaming"], r["async"], r["partial"], r["sync"]
        engine = r["streaming_engine"]
        idle_ratio, speed, met, target = _judge(cost, sp, r)
        _common.upsert_result_row(
            benchmark=f"streaming_partial_rollouts ({cost} cost)",
            metric=f"trainer idle fraction (steps/hour), GRPO loop, Pareto(1.3) lengths, {cost}-proportional simulated "
            f"decode in chunks of {partial.CHUNK}, max_staleness 1, late groups deferred",
            ours=f"streaming+partial {sp['idle_frac']:.2f} ({sp['steps_per_hour']:.0f}/h); before the last batch "
            f"{sp['idle_frac_before_last']:.2f}, last batch waits {sp['last_wait_s']:.2f} s; "
            f"{sp['interrupted_frac']:.2f} of groups interrupted",
            baseline=(_late_cell(late) if cost == "steps" else "")
            + f"streaming on one engine {engine['idle_frac']:.2f} ({engine['steps_per_hour']:.0f}/h); "
            f"streaming, each request its own version {stream['idle_frac']:.2f} ({stream['steps_per_hour']:.0f}/h); async "
            f"{plain['idle_frac']:.2f} ({plain['steps_per_hour']:.0f}/h); partial {part['idle_frac']:.2f} "
            f"({part['steps_per_hour']:.0f}/h); sync {sync['idle_frac']:.2f} ({sync['steps_per_hour']:.0f}/h)",
            ratio=f"idle x{idle_ratio:.2f} vs async, steps/h x{speed:.2f} vs sync",
            target=_common.target_cell(target, met),
            machine=_common.machine_label(info),
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
