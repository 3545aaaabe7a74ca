"""``workflow.name: verifiers`` with a tool environment (issue 38): a verifiers 0.4 taskset whose `vf.Toolset` (an MCP
tool server that verifiers starts as a subprocess) is defined here; our harness connects to it, advertises its tool
to the model through the endpoint, runs the model's call over MCP and sends the result back; 1 GRPO step trains.

The tiny random model never writes a tool call by itself, so the rollout engine (the real HF engine, named by import
path as ``rollout.engine``) answers an episode's first turn with a fixed ``<tool_call>`` in the chat template's syntax,
its log-probs teacher-forced under the same weights; every later turn is sampled. Everything between (the endpoint's
tool-call parsing, the openai client, verifiers' harness and MCP server) is the real code."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1")

MODULE = textwrap.dedent(
    """
    import dataclasses, json, os

    import torch
    import verifiers.v1 as vf

    CALL = '<tool_call>\\n{"name": "calc_double", "arguments": {"a": 3}}\\n</tool_call>'
    PROMPTS = []  # every prompt the engine got, decoded
    REPLIES = []  # (prompt, final reply) as the rubric saw them

    class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
        TOOL_PREFIX = "calc"

        @vf.tool
        def double(self, a: int) -> str:
            '''Twice a.'''
            with open(os.environ["VF_TOOL_LOG"], "a") as log:
                log.write(json.dumps({"a": a}) + "\\n")
            return str(2 * a)

    class SumData(vf.TaskData):
        a: int

    class SumTask(vf.Task[SumData]):
        @vf.reward
        async def shaped(self, task, trace) -> float:
            reply = trace.last_reply or ""
            REPLIES.append((task.prompt, reply))
            return task.a / 10 + 0.01 * len(reply)

    class ToolTaskset(vf.Taskset[SumTask]):
        def load(self):
            for a in range(8):
                yield SumTask(SumData(prompt=f"{a}+{a}=", a=a))

        @classmethod
        def toolsets(cls, config):
            return [CalcToolset(vf.ToolsetConfig())]

    def build_engine(model_dir, tokenizer, **kwargs):
        from shardforge.rollout.factory import build_hf_engine

        engine = build_hf_engine(model_dir, tokenizer, **kwargs)
        generate = engine.generate
        call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

        def forced(prompts, params, **options):
            outs = generate(prompts, params, **options)
            for k, out in enumerate(outs):
                text = tokenizer.decode(out.prompt_ids)
                PROMPTS.append(text)
                if "<tool_response>" in text:
                    continue
                ids = torch.tensor([list(out.prompt_ids) + call])
                with torch.no_grad():
                    logits = engine.model(ids).logits[0, len(out.prompt_ids) - 1 : -1].float()
                logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(call)[:, None])[:, 0]
                outs[k] = dataclasses.replace(out, response_ids=list(call), logprobs=logprobs.tolist(),
                                              finished=True, text=CALL, token_versions=None)
            return outs

        engine.generate = forced
        return engine

    __all__ = ["ToolTaskset"]

    if __name__ == "__main__":
        CalcToolset.run()
    """
)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing.agent_runs import agent_chat_assets

    root = tmp_path_factory.mktemp("vf_tools")
    return agent_chat_assets(root, "vf_tool_taskset", MODULE) | {"root": root}


def test_grpo_on_a_tool_environment_runs_the_tool_over_mcp_and_sends_its_result_back(
    chat: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vf_tool_taskset

    from shardforge.algorithms.testing.agent_runs import run_agent_grpo, train_records

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    tool_log = tmp_path / "tool_calls.jsonl"
    monkeypatch.setenv("VF_TOOL_LOG", str(tool_log))
    # verifiers starts the tool server as `python -m vf_tool_taskset`: the module must import there too.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(chat["root"]), os.environ.get("PYTHONPATH", "")]))
    workflow = {"name": "verifiers", "max_turns": 3, "verifiers": {"env": "vf_tool_taskset", "timeout_s": 120}}
    run_agent_grpo(
        chat,
        tmp_path / "run",
        workflow,
        steps=1,
        **{"rollout.engine": "vf_tool_taskset:build_engine", "engine.max_tokens_per_microbatch": 1024},
    )
    [record] = train_records(tmp_path / "run")
    assert record["episodes_failed"] == 0
    # Each of the 4 episodes called the tool once, with the arguments the model wrote, over MCP in verifiers' server.
    assert [json.loads(line) for line in tool_log.read_text().splitlines()] == [{"a": 3}] * 4
    # The tool's result came back to the model: 4 first-turn prompts, then 4 prompts that advertise the tool (its
    # schema in the system turn), carry the model's call and the result "6" as a tool response.
    prompts = vf_tool_taskset.PROMPTS
    with_result = [p for p in prompts if "<tool_response>\n6\n</tool_response>" in p]
    assert len(with_result) == 4 and len(prompts) == 8
    assert all('"calc_double"' in p and vf_tool_taskset.CALL in p for p in with_result)
    assert len(vf_tool_taskset.REPLIES) == 4  # the rubric scored every episode's final (second-turn) reply
    # The trained tokens are the recorded ones (the forced call's log-probs teacher-forced, the rest as sampled).
    assert record["behaviour_kl"] < 1e-4
    assert record["episode/turns"] == pytest.approx(2.0)
