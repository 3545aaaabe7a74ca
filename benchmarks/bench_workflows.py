"""Multi-turn workflows on the embedded HF engine: concurrent episodes vs one at a time, and vs single-turn.

Setup: the tiny chat model of the tests (`testing.tiny_chat_assets`: character tokenizer with Qwen3
chat markers, Qwen3 hidden ``HIDDEN``), the ``multi_turn`` workflow with ``TURNS`` turns and a
reward that is never right (so every episode runs all its turns: answer, "Wrong, try again." as a
user turn, answer again, ...), ``MAX_NEW_TOKENS`` per turn at temperature 1.

Measured, ``ROUNDS`` rounds alternating the order:

* concurrent: ``EPISODES`` episodes through `run_episodes` (one asyncio task per episode; their
  generate calls batched by the request queue: one engine call per turn for all episodes; the engine
  keeps each episode's KV cache between turns, so a turn prefills only the tokens it adds);
* concurrent, no KV reuse: the same on an engine built with ``kv_reuse=False`` (every turn re-encodes the
  whole conversation); its tokens must equal the reuse run's (same seed), checked;
* one at a time: the same episodes, each its own `run_episodes` call;
* single-turn: one ``generate`` of ``TURNS * MAX_NEW_TOKENS`` new tokens for each of the same prompts
  (the generated length a 3-turn episode produces, without the turn boundaries).

Reported: episodes/s concurrent vs one at a time (target >= 3x) and generated tokens/s of the
concurrent multi-turn episodes vs single-turn generation (target >= 0.8x; without KV reuse each turn
re-encodes the whole conversation, ~5x the single-turn prefill: 0.58x at hidden 64 before reuse).
Run: ``python benchmarks/bench_workflows.py`` (~2 min).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "workflows"
EPISODES = 32
TURNS = 3
MAX_NEW_TOKENS = 16
HIDDEN = 64
ROUNDS = 3


def never_right(prompt: str, response: str, reference: str) -> float:
    return 0.0


def _setup(root: Path) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_chat_assets
    from shardforge.rollout.hf.engine import HFRolloutEngine
    from shardforge.rollout.workflows.base import PromptRow, WorkflowConfig
    from shardforge.rollout.workflows.multi_turn import MultiTurnWorkflow

    assets = tiny_chat_assets(root, hidden=HIDDEN, layers=2)
    tokenizer = assets["tokenizer"]
    config = WorkflowConfig(name="multi_turn", max_turns=TURNS, chat_template=True)
    workflow = MultiTurnWorkflow(config, tokenizer, never_right)
    rows = [
        PromptRow(index=i, prompt=f"What is {i} + {2 * i + 1}?", reference=str(3 * i + 1), prompt_ids=[])
        for i in range(EPISODES)
    ]
    prompts = [workflow.codec.prompt_ids(row.prompt, row.prompt_ids) for row in rows]
    return {"engine": HFRolloutEngine(assets["model"], tokenizer),
            "engine_no_reuse": HFRolloutEngine(assets["model"], tokenizer, kv_reuse=False), "workflow": workflow, "rows": rows,
            "prompts": prompts}  # fmt: skip


def _generated(trajectories: list[Any]) -> int:
    return sum(turn.generated for t in trajectories for turn in t.turns)


def run_concurrent(s: dict[str, Any], seed: int) -> dict[str, float]:
    from shardforge.rollout.types import SamplingParams
    from shardforge.rollout.workflows.runner import run_episodes

    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=seed)
    start = time.perf_counter()
    out = run_episodes(s["workflow"], s["engine"], s["rows"], 1, params, drop_failed=False)
    seconds = time.perf_counter() - start
    s.setdefault("samples", {}).setdefault(seed, []).append([t.token_ids for t in out])
    turns = sum(len(t.turns) for t in out) / len(out)
    return {"seconds": seconds, "episodes": len(out), "tokens": _generated(out), "turns": turns,
            "generate_calls": out.generate_calls}  # fmt: skip


def run_concurrent_no_reuse(s: dict[str, Any], seed: int) -> dict[str, float]:
    return run_concurrent(s | {"engine": s["engine_no_reuse"]}, seed)


def run_one_at_a_time(s: dict[str, Any], seed: int) -> dict[str, float]:
    from shardforge.rollout.types import SamplingParams
    from shardforge.rollout.workflows.runner import run_episodes

    start = time.perf_counter()
    tokens = episodes = calls = 0
    for i, row in enumerate(s["rows"]):
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=seed * 1_000 + i)
        out = run_episodes(s["workflow"], s["engine"], [row], 1, params, drop_failed=False)
        tokens, episodes, calls = tokens + _generated(out), episodes + len(out), calls + out.generate_calls
    return {"seconds": time.perf_counter() - start, "episodes": episodes, "tokens": tokens, "generate_calls": calls}


def run_single_turn(s: dict[str, Any], seed: int) -> dict[str, float]:
    from shardforge.rollout.types import SamplingParams

    params = SamplingParams(max_new_tokens=TURNS * MAX_NEW_TOKENS, temperature=1.0, seed=seed)
    start = time.perf_counter()
    out = s["engine"].generate(s["prompts"], params)
    return {"seconds": time.perf_counter() - start, "episodes": len(out),
            "tokens": sum(len(r.response_ids) for r in out)}  # fmt: skip


def main() -> int:
    started = time.perf_counter()
    info = _common.machine_info()
    fns = {"concurrent": run_concurrent, "concurrent_no_reuse": run_concurrent_no_reuse,
           "one_at_a_time": run_one_at_a_time, "single_turn": run_single_turn}  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in fns}
    with tempfile.TemporaryDirectory(prefix="bench_workflows_") as tmp:
        s = _setup(Path(tmp))
        run_concurrent(s, seed=99)  # warm-up (first-call allocations)
        for index in range(ROUNDS):
            order = list(fns) if index % 2 == 0 else list(reversed(fns))
            for mode in order:
                run = fns[mode](s, seed=index)
                runs[mode].append(run)
                print(f"[{NAME}] round {index + 1} {mode}: {run['episodes'] / run['seconds']:.2f} episodes/s, "
                      f"{run['tokens'] / run['seconds']:,.0f} generated tok/s", flush=True)  # fmt: skip
        # Same seed, with and without KV reuse: the same tokens (reuse is exact up to float reduction order).
        identical = all(pair[0] == pair[1] for pair in s["samples"].values() if len(pair) == 2)
    eps = [
        c["episodes"] / c["seconds"] / (o["episodes"] / o["seconds"])
        for c, o in zip(runs["concurrent"], runs["one_at_a_time"])
    ]
    tps = [
        c["tokens"] / c["seconds"] / (t["tokens"] / t["seconds"])
        for c, t in zip(runs["concurrent"], runs["single_turn"])
    ]
    tps_no_reuse = [
        c["tokens"] / c["seconds"] / (t["tokens"] / t["seconds"])
        for c, t in zip(runs["concurrent_no_reuse"], runs["single_turn"])
    ]
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    payload = {"benchmark": NAME, "episodes": EPISODES, "turns": TURNS, "max_new_tokens": MAX_NEW_TOKENS,
               "hidden": HIDDEN, "rounds": ROUNDS, "runs": runs, "median": med,
               "episodes_ratio": eps, "tokens_ratio": tps, "tokens_ratio_no_kv_reuse": tps_no_reuse,
               "kv_reuse_tokens_identical": identical, "machine": info, "date": _common.today(),
               "seconds": time.perf_counter() - started}  # fmt: skip
    json_path = _common.write_json(NAME, payload)
    setting = (f"{EPISODES} 3-turn multi_turn episodes x {MAX_NEW_TOKENS} new tokens per turn, embedded HF engine, "
               f"tiny chat Qwen3 hidden {HIDDEN}; median of {ROUNDS} alternated rounds")  # fmt: skip
    conc, one, single = med["concurrent"], med["one_at_a_time"], med["single_turn"]
    _common.upsert_result_row(
        benchmark="workflows_concurrency",
        metric=f"episodes/s, concurrent (request queue: {conc['generate_calls']:.0f} engine calls) vs one episode at "
        f"a time ({one['generate_calls']:.0f} calls); {setting}",
        ours=f"{conc['episodes'] / conc['seconds']:.2f}",
        baseline=f"{one['episodes'] / one['seconds']:.2f}",
        ratio=f"{statistics.median(eps):.2f} (min {min(eps):.2f})",
        target=_common.target_cell(">= 3x", statistics.median(eps) >= 3.0),
        machine=_common.machine_label(info),
    )
    _common.upsert_result_row(
        benchmark="workflows_vs_single_turn",
        metric=f"generated tokens/s, concurrent multi-turn episodes (KV reused across turns; without reuse "
        f"{statistics.median(tps_no_reuse):.2f}x, same tokens: {identical}) vs one single-turn generate of "
        f"{TURNS * MAX_NEW_TOKENS} new tokens per prompt; {setting}",
        ours=f"{conc['tokens'] / conc['seconds']:,.0f}",
        baseline=f"{single['tokens'] / single['seconds']:,.0f}",
        ratio=f"{statistics.median(tps):.2f} (min {min(tps):.2f})",
        target=_common.target_cell(">= 0.8x", statistics.median(tps) >= 0.8),
        machine=_common.machine_label(info),
    )
    print(f"[{NAME}] concurrent / one at a time: {statistics.median(eps):.2f}x episodes/s (target >= 3); multi-turn / "
          f"single-turn: {statistics.median(tps):.2f}x tokens/s (target >= 0.8; without KV reuse "
          f"{statistics.median(tps_no_reuse):.2f}x; same tokens: {identical}); wrote {json_path}")  # fmt: skip
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
