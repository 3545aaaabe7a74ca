"""The tool-use workflow: the model calls tools in its chat template's own format (Qwen3 / Hermes:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), the workflow runs them and appends
each result as a ``tool`` message; the episode ends on a turn without a tool call (the final
answer, scored by the reward function) or after ``max_turns`` model turns (reward 0).

A bad call (malformed, unknown tool, bad arguments, exception, timeout) is answered with an error
message as the tool result and counted by kind in `TurnInfo.tool_errors`; it never raises.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from shardforge.rollout.episodes.request_queue import EpisodeHandle
from shardforge.rollout.episodes.trajectory import Trajectory, TurnInfo
from shardforge.rollout.workflows.base import PromptRow, WorkflowConfig, new_trajectory, score_in_batch
from shardforge.rollout.workflows.chat import ChatCodec
from shardforge.rollout.workflows.tools import load_tools, run_tool_call

__all__ = ["ToolUseWorkflow", "parse_tool_calls"]

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_tool_calls(text: str) -> list[str]:
    """The bodies of the ``<tool_call>`` blocks of ``text``; an unclosed block counts as one (malformed) call."""
    calls = [body.strip() for body in TOOL_CALL.findall(text)]
    rest = TOOL_CALL.sub("", text)
    if "<tool_call>" in rest:
        calls.append(rest.split("<tool_call>", 1)[1].strip())
    return calls


class ToolUseWorkflow:
    """Tool calls until a final answer; tool results are environment tokens (loss mask 0)."""

    def __init__(self, config: WorkflowConfig, tokenizer: Any, reward_fn: Any) -> None:
        self.config, self.reward_fn = config, reward_fn
        self.tools = load_tools(config.tool_use.tools)
        self.codec = ChatCodec(
            tokenizer, chat_template=config.chat_template, system_prompt=config.system_prompt,
            tools=[tool.schema for tool in self.tools.values()],
        )  # fmt: skip

    async def run_episode(self, engine: EpisodeHandle, row: PromptRow) -> list[Trajectory]:
        config = self.config
        trajectory = new_trajectory(
            row, self.codec.prompt_ids(row.prompt, row.prompt_ids, rendered=row.images is not None)
        )
        trajectory.stop_reason = "max_turns"
        for turn in range(config.max_turns):
            budget = config.max_total_tokens
            if budget is not None and len(trajectory.token_ids) + engine.params.max_new_tokens > budget:
                trajectory.stop_reason = "max_tokens"
                break
            out = await engine.generate(trajectory.token_ids)
            trajectory.append(out.response_ids, logprobs=out.logprobs, version=out.versions, routing=out.routed_experts)
            trajectory.text = out.text
            calls = parse_tool_calls(out.text)
            info = TurnInfo(generated=len(out.response_ids), finished=out.finished, tool_calls=len(calls))
            trajectory.turns.append(info)
            if not calls:
                answer = out.text.split("</think>")[-1].strip()
                trajectory.reward = info.reward = await score_in_batch(engine, self.reward_fn, row, answer)
                trajectory.stop_reason = "answer"
                break
            results = await asyncio.gather(
                *(run_tool_call(body, self.tools, timeout_s=config.tool_use.timeout_s) for body in calls)
            )
            info.tool_errors = [result.error for _, result in results if result.error is not None]
            if turn == config.max_turns - 1:
                break
            messages = [{"role": "tool", "name": name, "content": result.content} for name, result in results]
            trajectory.append(self.codec.continuation_ids(messages, finished=out.finished))
        return [trajectory]
