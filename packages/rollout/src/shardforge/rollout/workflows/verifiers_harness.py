"""``shardforge_chat``: a verifiers 0.4 harness that runs its chat loop in this process (imports verifiers).

verifiers' own chat harnesses (``null``, ``bash``) launch a PEP 723 script that ``uv`` provisions from the network
per runtime; this one runs the same loop (chat, the task's MCP tools, repeat until a reply without tool calls) as
a coroutine, every model call through the rollout's interception ``endpoint`` and ``secret``, as verifiers'
`Harness.launch` contract allows. verifiers' loader imports a harness by a top-level module name (a dotted id is
looked up under ``verifiers.v1.harnesses``), so this module registers itself as ``shardforge_chat``.
"""

from __future__ import annotations

import json
import sys
from contextlib import AsyncExitStack
from typing import Any

import openai
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult

__all__ = ["HARNESS_ID", "InProcessChatHarness", "InProcessChatHarnessConfig", "chat_env"]

HARNESS_ID = "shardforge_chat"
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])


class InProcessChatHarnessConfig(vf.HarnessConfig):
    max_turns: int = 8
    """Most model calls per episode (tool calls + the final answer)."""


class InProcessChatHarness(vf.Harness[InProcessChatHarnessConfig]):
    """Chat until a reply without tool calls (or ``max_turns``), the task's MCP tools in the loop."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(  # type: ignore[override]
        self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: dict[str, str], data: Any,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:  # fmt: skip
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(message) for message in prompt)
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        servers_config = {
            "mcpServers": {n: {"url": u, "timeout": self.config.tool_timeout} for n, u in mcp_urls.items()}
        }
        async with AsyncExitStack() as stack:
            stack.push_async_callback(client.close)
            tools, dispatch, servers = await connect_mcp(servers_config, stack) if mcp_urls else ([], {}, {})
            for _ in range(self.config.max_turns):
                extra = {"tools": tools} if tools else {}
                reply = await client.chat.completions.create(model=ctx.model, messages=messages, **extra)  # type: ignore[call-overload,arg-type]
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    if not hasattr(call, "function"):  # a custom (free-form) tool call: no MCP tool serves it
                        continue
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                     "content": await _call(servers, dispatch, call)})  # fmt: skip
        return ProgramResult(exit_code=0, stdout="", stderr="")


async def _call(servers: dict[str, Any], dispatch: dict[str, Any], call: Any) -> Any:
    """The tool's result, or an error message the model sees (a bad call ends nothing)."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: invalid JSON arguments ({exc})"
    if call.function.name not in dispatch or not isinstance(arguments, dict):
        return f"error: unknown tool {call.function.name!r} or arguments not an object"
    return await call_mcp(servers, dispatch, call.function.name, arguments)


def chat_env(taskset: str, *, max_turns: int = 8, **taskset_args: Any) -> vf.Env:
    """The environment of taskset ``taskset`` (a verifiers taskset id) with one agent seat played by this harness
    in a local subprocess runtime (no container, no network): what ``workflow.verifiers.env: <id>`` builds."""
    config = vf.resolve_env_config({
        "taskset": {"id": taskset, **taskset_args},
        "agent": {"harness": {"id": HARNESS_ID, "max_turns": max_turns}, "runtime": {"type": "subprocess"}},
    })  # fmt: skip
    return vf.load_environment(config)
