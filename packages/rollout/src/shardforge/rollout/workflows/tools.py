"""Tools an agent can call: plain Python callables with a JSON schema, and the built-ins.

A tool is any function; its JSON schema (the HF / OpenAI ``{"type": "function", ...}`` format the
chat templates take as ``tools=``) comes from its signature and docstring, or is given. Every way a
call can go wrong becomes an error string returned to the model as the tool result, with a kind
counted in the metrics, and never an exception in the trainer:

    malformed      the <tool_call> body is not JSON {"name": ..., "arguments": {...}}
    unknown_tool   no tool of that name
    bad_arguments  the arguments do not bind to the signature
    exception      the tool raised
    timeout        the tool ran past its time limit (an async tool is cancelled, a subprocess killed)

Built-ins: ``calculator`` (arithmetic on an `ast` whitelist; no ``eval``) and ``python`` (runs code
in a fresh ``python -I`` subprocess with CPU-time and memory limits, no network, killed on timeout).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardforge.core.registry import Registry

__all__ = ["TOOLS", "Tool", "ToolResult", "calculator", "python", "tool_schema"]

TOOLS: Registry[Callable[..., Any]] = Registry("tool")

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable[..., Any], *, name: str | None = None) -> dict[str, Any]:
    """The HF/OpenAI function schema of ``fn`` from its signature (annotations -> JSON types) and docstring."""
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in signature.parameters.values():
        if param.name == "timeout_s":  # set by the workflow (workflow.tool_use.timeout_s), never by the model
            continue
        hint = hints.get(param.name, str)
        properties[param.name] = {"type": _JSON_TYPES.get(hint, "string")}
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    doc = inspect.getdoc(fn) or ""
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": doc.splitlines()[0] if doc else "",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What the model sees (``content``) and what the metrics count (``error``: None or an error kind)."""

    content: str
    error: str | None = None


class Tool:
    """A callable (sync or async) with a name, a schema and a per-call timeout."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, schema: dict[str, Any] | None = None):
        self.fn, self.name = fn, name or fn.__name__
        self.schema = schema or tool_schema(fn, name=self.name)
        self.signature = inspect.signature(fn)

    async def call(self, arguments: Any, *, timeout_s: float) -> ToolResult:
        if not isinstance(arguments, dict):
            return ToolResult(f"error: arguments of {self.name} must be a JSON object", "bad_arguments")
        arguments = {k: v for k, v in arguments.items() if k != "timeout_s"}
        if "timeout_s" in self.signature.parameters:
            arguments["timeout_s"] = timeout_s
        try:
            self.signature.bind(**arguments)
        except TypeError as err:
            return ToolResult(f"error: bad arguments for {self.name}: {err}", "bad_arguments")
        try:
            if inspect.iscoroutinefunction(self.fn):
                # A small grace period: a tool that limits itself (python) reports its own timeout.
                value = await asyncio.wait_for(self.fn(**arguments), timeout_s + 1.0)
            else:
                # A thread cannot be killed: past the limit the call is abandoned (it runs on in the
                # background); tools that may hang should be async or use a subprocess.
                value = await asyncio.wait_for(asyncio.to_thread(self.fn, **arguments), timeout_s)
        except TimeoutError:
            return ToolResult(f"error: {self.name} timed out after {timeout_s:g}s", "timeout")
        except ToolTimeout as err:
            return ToolResult(f"error: {err}", "timeout")
        except Exception as err:
            return ToolResult(f"error: {self.name} raised {type(err).__name__}: {err}", "exception")
        return ToolResult(value if isinstance(value, str) else json.dumps(value))


class ToolTimeout(Exception):
    """Raised by a tool that enforces its own time limit (the python tool's killed subprocess)."""


async def run_tool_call(body: str, tools: dict[str, Tool], *, timeout_s: float) -> tuple[str, ToolResult]:
    """Parse one ``<tool_call>`` body (``{"name": ..., "arguments": {...}}``) and run it: (tool name, result)."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return "", ToolResult(f"error: the tool call is not valid JSON ({err.msg})", "malformed")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return "", ToolResult('error: a tool call is {"name": ..., "arguments": {...}}', "malformed")
    name = call["name"]
    if name not in tools:
        return name, ToolResult(f"error: unknown tool {name!r}; tools: {sorted(tools)}", "unknown_tool")
    return name, await tools[name].call(call.get("arguments", {}), timeout_s=timeout_s)


def load_tools(names: tuple[str, ...] | list[str]) -> dict[str, Tool]:
    """Tools by registered name (calculator, python) or import path (``package.module:function``)."""
    tools = {}
    for name in names:
        fn = TOOLS.get(name)
        tool = Tool(fn, name=name if ":" not in name else None)
        tools[tool.name] = tool
    return tools


_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY: dict[type[ast.unaryop], Callable[[Any], float | int]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__} (numbers and + - * / // % ** only)")


@TOOLS.register("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses."""
    value = _evaluate(ast.parse(expression, mode="eval"))
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)
    return str(value)


_PYTHON_PRELUDE = """
import resource, socket, sys
resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
def _no_network(*a, **k):
    raise OSError("network access is disabled in the python tool")
socket.socket = _no_network
socket.create_connection = _no_network
del resource, socket, _no_network
"""
PYTHON_MEMORY_BYTES = 512 * 2**20
"""Address-space limit of the python tool's subprocess."""


@TOOLS.register("python")
async def python(code: str, timeout_s: float = 5.0) -> str:
    """Run Python code in a subprocess and return its stdout (and stderr)."""
    cpu = max(1, math.ceil(timeout_s))
    prelude = _PYTHON_PRELUDE.format(mem=PYTHON_MEMORY_BYTES, cpu=cpu)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", prelude + code,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        raise ToolTimeout(f"python timed out after {timeout_s:g}s (killed)") from None
    finally:  # also when the caller's own deadline cancels us: never leave the process running
        if process.returncode is None:
            process.kill()
            await asyncio.shield(process.wait())
    out = stdout.decode(errors="replace")[-2000:]
    if process.returncode:
        raise RuntimeError(f"exit code {process.returncode}: {stderr.decode(errors='replace')[-500:]}")
    return out
