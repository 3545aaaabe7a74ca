"""OpenAI request parsing and response building for the endpoint (`server`): pure functions, no HTTP.

Errors are `APIError` with the HTTP status and the body OpenAI clients parse
(``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardforge.rollout.types import Rollout, SamplingParams

__all__ = ["APIError", "Completion", "chat_prompt_ids", "completion_prompt_ids", "finish", "sampling_params"]

MAX_N = 64


class APIError(Exception):
    """A request the endpoint refuses: ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise APIError(400, f"{key}={value!r} must be a number in [{low}, {high}]", key)
    return float(value)


def _integer(body: dict[str, Any], key: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise APIError(400, f"{key}={value!r} must be an integer in [{low}, {high}]", key)
    return value


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise APIError(400, f"stop={stop!r} must be a non-empty string or a list of up to 4 of them", "stop")
    return stops


def sampling_params(body: dict[str, Any], *, max_tokens_limit: int) -> SamplingParams:
    """The engine's sampling parameters of a chat or text completion request."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, key, max_tokens_limit, 1, max_tokens_limit)
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise APIError(400, "top_logprobs is not supported: the engine returns each sampled token's log-prob "
                       "(logprobs=true) but no alternatives", "top_logprobs")  # fmt: skip
    seed = _integer(body, "seed", None, 0, 2**62)
    return SamplingParams(
        n=int(_integer(body, "n", 1, 1, MAX_N) or 1), max_new_tokens=int(max_tokens or 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        seed=seed,
    )  # fmt: skip


def chat_prompt_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The prompt as the engine is fed it: the tokenizer's chat template over ``messages`` (and ``tools``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant",
                                                                         "tool"):  # fmt: skip
            raise APIError(400, f"messages[{i}] must be an object with role system|user|assistant|tool", "messages")
        if message["role"] == "developer":  # OpenAI's newer name of the system role
            messages[i] = {**message, "role": "system"}
        if isinstance(message.get("content"), list):  # content parts: the text ones, joined
            parts = message["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            messages[i] = {**messages[i], "content": "".join(str(p.get("text", "")) for p in parts)}
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be a list of {type: function, function: {...}} objects", "tools")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template's own error (jinja): the client's messages do not fit it
        raise APIError(400, f"the model's chat template refused the messages: {exc}", "messages") from exc
    return encode(tokenizer, text)


def encode(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]``, through the Rust tokenizer directly when the
    tokenizer is a fast one (the same ids; transformers' ``__call__`` adds ~2 ms of Python per long prompt)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def completion_prompt_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return encode(tokenizer, prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


@dataclass(frozen=True, slots=True)
class Completion:
    """One choice as returned: the ids kept (cut after a stop string), their log-probs and text."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


def finish(tokenizer: Any, rollout: Rollout, stops: Sequence[str]) -> tuple[Completion, Rollout]:
    """Apply ``stops`` to one rollout: text up to the first stop string, ids up to the token that completed it
    (as vLLM reports them); returns the choice and the rollout as recorded (the same cut)."""
    ids, logprobs = list(rollout.response_ids), list(rollout.logprobs)
    eos = tokenizer.eos_token_id
    reason = "stop" if rollout.finished else "length"
    # Cut only where a stop string occurs in the whole text: then find the token that completes it (the prefix
    # decodes are paid only by completions that do stop).
    if stops and any(stop in tokenizer.decode(ids, skip_special_tokens=True) for stop in stops):
        for k in range(1, len(ids) + 1):
            text = tokenizer.decode(ids[:k], skip_special_tokens=True)
            hit = [text.index(s) for s in stops if s in text]
            if hit:
                ids, logprobs, reason = ids[:k], logprobs[:k], "stop"
                text = text[: min(hit)]
                cut = Rollout(
                    prompt_index=rollout.prompt_index, prompt_ids=rollout.prompt_ids, response_ids=ids,
                    logprobs=logprobs, finished=True, version=rollout.version, text=text,
                    token_versions=None if rollout.token_versions is None else rollout.token_versions[:k],
                )  # fmt: skip
                return Completion(ids, logprobs, text, reason), cut
    shown = ids[:-1] if ids and ids[-1] == eos else ids
    text = tokenizer.decode(shown, skip_special_tokens=True)
    return Completion(ids, logprobs, text, reason), rollout


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Qwen3 / Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks as OpenAI ``tool_calls``
    (arguments as a JSON string); a block that is not such JSON stays in the content."""
    from shardforge.rollout.workflows.tool_use import TOOL_CALL

    calls: list[dict[str, Any]] = []
    kept = text
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1).strip())
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        })  # fmt: skip
        kept = kept.replace(match.group(0), "", 1)
    return (kept.strip() if calls else text), calls


def token_logprobs(tokenizer: Any, completion: Completion) -> dict[str, Any]:
    content = []
    for token_id, logprob in zip(completion.ids, completion.logprobs, strict=True):
        token = tokenizer.decode([token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content}


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
