"""The OpenAI-compatible endpoint's cost: the same episodes through it vs the in-process ``tool_use`` workflow.

Setup: the tiny chat model of the tests (`testing.tiny_chat_assets` with Qwen3's tool template, Qwen3 hidden
``HIDDEN``), ``EPISODES`` concurrent episodes of one chat turn with the calculator tool in the prompt,
``MAX_NEW_TOKENS`` new tokens at temperature 1, on the embedded HF engine through the trainer's request queue
(`run_episodes`):

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
MAX_NEW_TOKENS = 16
HIDDEN = 64
ROUNDS = 3


async def agent(client: Any, row: dict[str, Any]) -> float:
    """The episode as an OpenAI-client agent: one chat request with the calculator tool."""
    from shardforge.rollout.workflows.tools import calculator, tool_schema

    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], tools=[tool_schema(calculator)]
    )
    return 0.0


def _setup(root: Path) -> dict[str, Any]:
    from shardforge.algorithms.testing import QWEN3_TOOL_TEMPLATE, tiny_chat_assets
    from shardforge.rollout.hf.engine import HFRolloutEngine
    from shardforge.rollout.workflows.agent import AgentWorkflow
    from shardforge.rollout.workflows.base import AgentConfig, PromptRow, ToolUseConfig, WorkflowConfig
    from shardforge.rollout.workflows.tool_use import ToolUseWorkflow

    assets = tiny_chat_assets(root, hidden=HIDDEN, layers=2, chat_template=QWEN3_TOOL_TEMPLATE)
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


def _run(s: dict[str, Any], workflow: str, seed: int) -> dict[str, Any]:
    from shardforge.rollout.types import SamplingParams
    from shardforge.rollout.workflows.runner import run_episodes

    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=seed)
    start, cpu = time.perf_counter(), time.process_time()
    out = run_episodes(s[workflow], s["engine"], s["rows"], 1, params, drop_failed=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(sum(t.loss_mask) for t in out)
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens, "ids": [t.token_ids for t in out]}


def main() -> int:
    started = time.perf_counter()
    info = _common.machine_info()
    runs: dict[str, list[dict[str, Any]]] = {"in_process": [], "endpoint": []}
    same = True
    with tempfile.TemporaryDirectory(prefix="bench_agent_endpoint_") as tmp:
        s = _setup(Path(tmp))
        _run(s, "tool_use", 99), _run(s, "agent", 99)  # warm-up
        for index in range(ROUNDS):
            order = [("in_process", "tool_use"), ("endpoint", "agent")]
            results = {}
            for mode, workflow in order if index % 2 == 0 else reversed(order):
                results[mode] = run = _run(s, workflow, seed=index)
                runs[mode].append(
                    {"seconds": run["seconds"], "cpu_seconds": run["cpu_seconds"], "tokens": run["tokens"]}
                )
                print(f"[{NAME}] round {index + 1} {mode}: {run['tokens'] / run['seconds']:,.0f} generated tok/s "
                      f"({run['seconds']:.2f} s, {run['cpu_seconds']:.2f} CPU s)", flush=True)  # fmt: skip
            same = same and results["in_process"]["ids"] == results["endpoint"]["ids"]
    ratios = [
        e["tokens"] / e["seconds"] / (p["tokens"] / p["seconds"]) for e, p in zip(runs["endpoint"], runs["in_process"])
    ]
    # CPU seconds of this process (all its threads): on a machine shared with other work, wall time also counts
    # the waits for a core; the CPU ratio is the endpoint's own cost.
    cpu_ratios = [p["cpu_seconds"] / e["cpu_seconds"] for e, p in zip(runs["endpoint"], runs["in_process"])]
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    payload = {"benchmark": NAME, "episodes": EPISODES, "max_new_tokens": MAX_NEW_TOKENS, "hidden": HIDDEN,
               "rounds": ROUNDS, "runs": runs, "median": med, "ratio": ratios, "cpu_ratio": cpu_ratios, "same_tokens": same, "machine": info,
               "date": _common.today(), "seconds": time.perf_counter() - started}  # fmt: skip
    json_path = _common.write_json(NAME, payload)
    ratio = statistics.median(ratios)
    _common.upsert_result_row(
        benchmark="agent_endpoint",
        metric=f"generated tokens/s of {EPISODES} concurrent one-turn tool-prompt episodes through the OpenAI endpoint "
        f"(openai.AsyncOpenAI per episode over HTTP, workflow agent) vs the in-process tool_use workflow; same tokens: "
        f"{same}; embedded HF engine, tiny chat Qwen3 hidden {HIDDEN}, {MAX_NEW_TOKENS} new tokens; median of "
        f"{ROUNDS} alternated rounds",
        ours=f"{med['endpoint']['tokens'] / med['endpoint']['seconds']:,.0f}",
        baseline=f"{med['in_process']['tokens'] / med['in_process']['seconds']:,.0f}",
        ratio=f"{ratio:.2f} (min {min(ratios):.2f}; per CPU second {statistics.median(cpu_ratios):.2f})",
        target=_common.target_cell(">= 0.8x", ratio >= 0.8),
        machine=_common.machine_label(info),
    )
    print(f"[{NAME}] endpoint / in process: {ratio:.2f}x generated tokens/s (target >= 0.8), "
          f"{statistics.median(cpu_ratios):.2f}x per CPU second; same tokens: {same}; wrote {json_path}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
