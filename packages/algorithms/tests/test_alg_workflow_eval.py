"""Held-out evaluation through workflows: `evaluate_workflow` with the real tool_use workflow, the
calculator and a Qwen3-style tool template against a deterministic tool-using stub engine whose
metrics are computed here (success@1, avg@n, pass@k, turns, tool calls and errors by kind, reward
per turn, stop reasons, crashed episodes), split over two data-parallel "ranks"; then
``shardforge eval`` with ``workflow.name=tool_use`` on the tiny model end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.trainers.rl.eval import EvalSamplingConfig
from shardforge.algorithms.trainers.rl.workflow_eval import evaluate_workflow
from shardforge.engine.objectives.passk import pass_at_k
from shardforge.rollout import Rollout, SamplingParams
from shardforge.rollout.types import PromptSet
from shardforge.rollout.workflows import WorkflowConfig, build_workflow

NUM_PROMPTS, SAMPLES, MAX_TURNS = 10, 4, 3


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import QWEN3_TOOL_TEMPLATE, tiny_chat_assets

    return tiny_chat_assets(tmp_path_factory.mktemp("wf_eval"), seed=6, chat_template=QWEN3_TOOL_TEMPLATE)


def _call(name: str, expression: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


class ToolStub:
    """A rollout engine that plays the agent by a table. Prompt ``i+1=`` (reference i+1), greedy, by i % 5:

    0: calls calculator("i+1"), then answers the tool's result       2 turns, 1 call, reward 1
    1: a malformed call, then answers "0"                             2 turns, 1 call (malformed), reward 0
    2: answers i+1 at once                                            1 turn, reward 1
    3: calls the unknown tool "abacus" every turn                     3 turns (max_turns), 3 calls (unknown_tool)
    4: answers "boom" (the reward function raises)                    crashed: scored 0, no turns

    Sampled episode j of prompt i calls calculator("i+1") when j < i % 4, else calculator("i+2"), then
    answers the result: j < i % 4 of the samples are right.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.samples_seen = tokenizer, {}

    def _reply(self, text: str, params: SamplingParams) -> str:
        i = int(re.search(r"user\n(\d+)\+1=", text).group(1))  # type: ignore[union-attr]
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if params.temperature > 0:
            if results:
                return results[-1]
            j = self.samples_seen[i] = self.samples_seen.get(i, -1) + 1
            return _call("calculator", f"{i}+1" if j < i % 4 else f"{i}+2")
        kind = i % 5
        if kind == 0:
            return results[-1] if results else _call("calculator", f"{i}+1")
        if kind == 1:
            return "0" if results else "<tool_call>\n{not json\n</tool_call>"
        return {2: str(i + 1), 3: _call("abacus", f"{i}+1"), 4: "boom"}[kind]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        outs = []
        for p, ids in enumerate(prompts):
            reply = self._reply(self.tokenizer.decode(ids, skip_special_tokens=False), params)
            response = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            outs.append(Rollout(prompt_index=p, prompt_ids=list(ids), response_ids=response,
                                logprobs=[-0.1] * len(response), finished=True, version=0, text=reply))  # fmt: skip
        return outs

    def update_weights(self, version: int | None = None) -> int:
        return 0


class _Engine:
    def __init__(self, rank: int, size: int) -> None:
        self.dp_rank, self.dp_size, self.dp_group, self.device = rank, size, None, "cpu"


def _reward(prompt: str, response: str, reference: str) -> float:
    if response == "boom":
        raise KeyError("reward bug")
    return float(response.strip() == reference)


def _expected(prompts: range) -> dict[str, float]:
    """The metrics the table in `ToolStub` implies for prompts ``prompts`` (divided by NUM_PROMPTS)."""
    turns = {0: 2, 1: 2, 2: 1, 3: MAX_TURNS, 4: 0}
    calls = {0: 1, 1: 1, 2: 0, 3: MAX_TURNS, 4: 0}
    reward = {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0}
    kinds = [i % 5 for i in prompts]
    n = NUM_PROMPTS
    out = {
        "success@1": sum(reward[k] for k in kinds) / n,
        "turns_mean": sum(turns[k] for k in kinds) / n,
        "tool_calls_mean": sum(calls[k] for k in kinds) / n,
        "tool_errors_mean": sum({1: 1, 3: MAX_TURNS}.get(k, 0) for k in kinds) / n,
        "tool_errors/malformed": float(kinds.count(1)),
        "tool_errors/unknown_tool": float(MAX_TURNS * kinds.count(3)),
        "tool_errors/timeout": 0.0,
        "reward_per_turn": sum(reward[k] / turns[k] for k in kinds if turns[k]) / n,
        "stop/answer": sum(k in (0, 1, 2) for k in kinds) / n,
        "stop/max_turns": kinds.count(3) / n,
        "episodes_failed": float(kinds.count(4)),
        f"avg@{SAMPLES}": sum(min(i % 4, SAMPLES) / SAMPLES for i in prompts) / n,
    }
    for k in (1, 2, SAMPLES):
        out[f"pass@{k}"] = sum(pass_at_k(SAMPLES, i % 4, k) for i in prompts) / n
    return out


def test_workflow_eval_metrics_match_the_stub_table(chat: dict[str, Any]) -> None:
    tokenizer = chat["tokenizer"]
    config = WorkflowConfig(name="tool_use", chat_template=True, max_turns=MAX_TURNS, max_total_tokens=4096)
    workflow = build_workflow(config, tokenizer, _reward)
    texts = [f"{i}+1=" for i in range(NUM_PROMPTS)]
    prompts = PromptSet(texts, [str(i + 1) for i in range(NUM_PROMPTS)], [tokenizer(t)["input_ids"] for t in texts])
    sampling = EvalSamplingConfig(samples=SAMPLES, pass_k=(1, 2, SAMPLES), seed=3)
    got = evaluate_workflow(ToolStub(tokenizer), prompts, _Engine(0, 1), workflow, sampling, 48)  # type: ignore[arg-type]
    expected = _expected(range(NUM_PROMPTS))
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert got["accuracy"] == got["success@1"]
    assert got["tool_call_valid_rate"] == pytest.approx(0.2)  # greedy calls: 2 good (kind 0), 2 malformed, 6 unknown
    # Two data-parallel ranks (no process group: each rank's sums, added as the all-reduce would).
    halves = [evaluate_workflow(ToolStub(tokenizer), prompts, _Engine(r, 2), workflow, sampling, 48)  # type: ignore[arg-type]
              for r in (0, 1)]  # fmt: skip
    for key in expected:
        assert halves[0][key] + halves[1][key] == pytest.approx(got[key], abs=1e-12), key
    limited = evaluate_workflow(ToolStub(tokenizer), prompts, _Engine(0, 1), workflow, EvalSamplingConfig(), 48, 5)  # type: ignore[arg-type]
    assert limited["success@1"] == pytest.approx(_expected(range(5))["success@1"] * NUM_PROMPTS / 5)
    assert not any(k.startswith(("avg@", "pass@")) for k in limited)


def test_shardforge_eval_runs_a_tool_use_workflow(chat: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.eval_run import EvalConfig, run_eval

    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+3=", "completion": str(i + 3)}) + "\n" for i in range(4)))
    config = build_config(EvalConfig, {
        "model": chat["model"], "eval_files": [str(data)], "output_dir": str(tmp_path / "out"), "layout": "d1",
        "max_new_tokens": 12, "eval_sampling": {"samples": 2, "pass_k": [1, 2]},
        "workflow": {"name": "tool_use", "chat_template": True, "max_turns": 2},
        "engine": {"max_tokens_per_microbatch": 1024},
    })  # fmt: skip
    summary = run_eval(config)
    metrics = json.loads((tmp_path / "out" / "eval_results.json").read_text())["results"]["held_out"]
    assert metrics == pytest.approx(summary["results"]["held_out"])
    assert {"success@1", "avg@2", "pass@1", "pass@2", "turns_mean", "tool_calls_mean", "reward_per_turn"} <= set(
        metrics
    )
    assert 1 <= metrics["turns_mean"] <= 2 and metrics["num_prompts"] == 4
    assert 0 <= metrics["pass@1"] <= metrics["pass@2"] <= 1
    assert sum(v for k, v in metrics.items() if k.startswith("stop/")) == pytest.approx(1.0)
