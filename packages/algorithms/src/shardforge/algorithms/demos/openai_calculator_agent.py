"""An agent written against the OpenAI client only (no shardforge import), trained by
examples/grpo_openai_agent_tiny.yaml and by `shardforge demo-agent --openai-agent` through shardforge's
OpenAI-compatible endpoint (``workflow.agent.run: shardforge.algorithms.demos.openai_calculator_agent:run``; a
copy of this file anywhere works as ``path/to/file.py:run``).

It may call a calculator tool (OpenAI tool format); the tool's result goes back as a tool message and the model
answers. Its return value is the episode's reward (1.0 for the right sum)."""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

import openai

CALCULATOR: Any = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 123+456.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not arithmetic: {expression!r}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as exc:
        return f"error: {exc}"


async def run(client: openai.AsyncOpenAI, row: dict) -> float:
    messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):  # up to two tool calls, then the answer
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            # Qwen3-style models open each answer with a <think> block; the answer is what follows it.
            answer = (message.content or "").rsplit("</think>", 1)[-1].strip()
            return float(answer == row["reference"])
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
                result = calculator(str(arguments.get("expression", "")))
            except (ValueError, AttributeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
