"""The OpenAI-compatible endpoint's cost: the same episodes through it vs the in-process ``tool_use`` workflow.

Setup: the tiny chat model of the tests (`testing.tiny_chat_assets` with Qwen3's tool template), ``EPISODES``
concurrent episodes of one chat turn with the calculator tool in the prompt at temperature 1, on the embedded HF
engine through the trainer's request queue (`run_episodes`), in two shapes (``SHAPES``):

* ``agent_endpoint`` (the target row): the agent demo's model size (Qwen3 hidden 128, 2 layers) and per-turn
  budget (72 new tokens, `demos/demo_agent_grpo.yaml`);
* ``agent_endpoint_overhead`` (no target): hidden 64 and 16 new tokens, where generation costs almost nothing and
  the ratio is the endpoint's fixed per-request cost (the openai client, HTTP, JSON: ~6 ms of CPU a request on
  this machine) against almost no work. A larger model or longer answers move the ratio towards 1.

Both paths:

* in-process: the ``tool_use`` workflow (`ToolUseWorkflow`, ``max_turns`` 1);
* endpoint: the ``agent`` workflow running `agent` below, an `openai.AsyncOpenAI` client per episode
  sending the same messages and tools to `shardforge.rollout.openai` over HTTP on 127.0.0.1; the endpoint
  routes each request into the same request queue and records the tokens.

Both render the same prompt (checked) and sample with the same seeds, so they generate the same tokens
(checked). Reported: generated tokens/s through the endpoint / in process, median of ``ROUNDS`` alternated
rounds (target >= 0.8x), and the same ratio per CPU second of this process (all threads: the openai clients, the
endpoint's server thread, the engine), which a machine shared with other work distorts less than wall time. Run: ``python benchmarks/bench_agent_endpoint.py`` (~1 min).
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

NAME = "agent_endpoint"
EPISODES = 64
# (row name, Qwen3 hidden size, new tokens per request, whether the row carries the >= 0.8x target)
SHAPES = (("agent_endpoint", 128, 72, True), ("agent_endpoint_overhead", 64, 16, False))
ROUNDS = 3


async def agent(client: Any, row: dict[str, Any]) -> float:
    """The episode as an OpenAI-client agent: one chat request with the calculator tool."""
    from shardforge.rollout.workflows.tools import calculator, tool_schema

    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], tools=[tool_schema(calculator)]
    )
    return 0.0


def _setup(root: Path, hidden: int) -> dict[str, Any]:
    from shardforge.algorithms.testing import QWEN3_TOOL_TEMPLATE, tiny_chat_assets
    from shardforge.rollout.hf.engine import HFRolloutEngine
    from shardforge.rollout.workflows.agent import AgentWorkflow
    from shardforge.rollout.workflows.base import AgentConfig, PromptRow, ToolUseConfig, WorkflowConfig
    from shardforge.rollout.workflows.tool_use import ToolUseWorkflow

    assets = tiny_chat_assets(root, hidden=hidden, layers=2, chat_template=QWEN3_TOOL_TEMPLATE)
    tokenizer = assets["tokenizer"]
    tool_use = ToolUseWorkflow(
        WorkflowConfig(name="tool_use", max_turns=1, chat_template=True, tool_use=ToolUseConfig(tools=("calculator",))),
        tokenizer, lambda prompt, response, reference: 0.0,
    )  # fmt: skip
    through_endpoint = AgentWorkflow(
        WorkflowConfig(name="agent", agent=AgentConfig(run=f"{Path(__file__).resolve()}:agent", timeout_s=600)),
        tokenizer, lambda prompt, response, reference: 0.0,
    )  # fmt: skip
    rows = [PromptRow(index=i, prompt=f"{100 + i}+{2 * i + 7}=", reference=str(107 + 3 * i), prompt_ids=[])
            for i in range(EPISODES)]  # fmt: skip
    return {"engine": HFRolloutEngine(assets["model"], tokenizer), "tool_use": tool_use, "agent": through_endpoint,
            "rows": rows}  # fmt: skip


def _run(s: dict[str, Any], workflow: str, seed: int, max_new_tokens: int) -> dict[str, Any]:
    from shardforge.rollout.types import SamplingParams
    from shardforge.rollout.workflows.runner import run_episodes

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    start, cpu = time.perf_counter(), time.process_time()
    out = run_episodes(s[workflow], s["engine"], s["rows"], 1, params, drop_failed=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(sum(t.loss_mask) for t in out)
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens, "ids": [t.token_ids for t in out]}


def _measure(name: str, hidden: int, max_new: int, has_target: bool, info: dict[str, Any]) -> bool:
    """One shape: alternated rounds of both paths, its JSON and its RESULTS.md row; whether the tokens matched."""
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {"in_process": [], "endpoint": []}
    same = True
    with tempfile.TemporaryDirectory(prefix="bench_agent_endpoint_") as tmp:
        s = _setup(Path(tmp), hidden)
        _run(s, "tool_use", 99, max_new), _run(s, "agent", 99, max_new)  # warm-up
        for index in range(ROUNDS):
            order = [("in_process", "tool_use"), ("endpoint", "agent")]
            results = {}
            for mode, workflow in order if index % 2 == 0 else reversed(order):
                results[mode] = run = _run(s, workflow, index, max_new)
                runs[mode].append(
                    {"seconds": run["seconds"], "cpu_seconds": run["cpu_seconds"], "tokens": run["tokens"]}
                )
                print(f"[{name}] round {index + 1} {mode}: {run['tokens'] / run['seconds']:,.0f} generated tok/s "
                      f"({run['seconds']:.2f} s, {run['cpu_seconds']:.2f} CPU s)", flush=True)  # fmt: skip
            same = same and results["in_process"]["ids"] == results["endpoint"]["ids"]
    ratios = [
        e["tokens"] / e["seconds"] / (p["tokens"] / p["seconds"]) for e, p in zip(runs["endpoint"], runs["in_process"])
    ]
    # CPU seconds of this process (all its threads): on a machine shared with other work, wall time also counts
    # the waits for a core; the CPU ratio is the endpoint's own cost.
    cpu_ratios = [p["cpu_seconds"] / e["cpu_seconds"] for e, p in zip(runs["endpoint"], runs["in_process"])]
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    payload = {"benchmark": name, "episodes": EPISODES, "max_new_tokens": max_new, "hidden": hidden,
               "rounds": ROUNDS, "runs": runs, "median": med, "ratio": ratios, "cpu_ratio": cpu_ratios,
               "same_tokens": same, "machine": info, "date": _common.today(),
               "seconds": time.perf_counter() - started}  # fmt: skip
    json_path = _common.write_json(name, payload)
    ratio = statistics.median(ratios)
    target = _common.target_cell(">= 0.8x", ratio >= 0.8) if has_target else "none: the fixed per-request cost"
    _common.upsert_result_row(
        benchmark=name,
        metric=f"generated tokens/s of {EPISODES} concurrent one-turn tool-prompt episodes through the OpenAI endpoint "
        f"(openai.AsyncOpenAI per episode over HTTP, workflow agent) vs the in-process tool_use workflow; same tokens: "
        f"{same}; embedded HF engine, tiny chat Qwen3 hidden {hidden}, {max_new} new tokens; median of "
        f"{ROUNDS} alternated rounds",
        ours=f"{med['endpoint']['tokens'] / med['endpoint']['seconds']:,.0f}",
        baseline=f"{med['in_process']['tokens'] / med['in_process']['seconds']:,.0f}",
        ratio=f"{ratio:.2f} (min {min(ratios):.2f}; per CPU second {statistics.median(cpu_ratios):.2f})",
        target=target,
        machine=_common.machine_label(info),
    )
    print(f"[{name}] endpoint / in process: {ratio:.2f}x generated tokens/s ({target}), "
          f"{statistics.median(cpu_ratios):.2f}x per CPU second; same tokens: {same}; wrote {json_path}")  # fmt: skip
    return same


def main() -> int:
    info = _common.machine_info()
    same = [_measure(name, hidden, max_new, has_target, info) for name, hidden, max_new, has_target in SHAPES]
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
