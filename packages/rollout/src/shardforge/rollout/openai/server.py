"""An OpenAI-compatible HTTP endpoint in front of any `RolloutEngine`, recording exact tokens per episode.

    server = OpenAIEndpoint(engine, tokenizer, model_name="policy").start()   # a background thread
    client = openai.OpenAI(base_url=server.url, api_key="episode-17")         # the key names the episode
    ...                                                                        # any agent code
    record = server.recorder.pop("episode-17")                                 # its token-exact trajectories

Routes: ``/v1/chat/completions`` (tools; ``tool_calls`` parsed from the model's ``<tool_call>`` blocks;
``logprobs``; ``n``; ``stop``; ``seed``; ``stream``), ``/v1/completions``, ``/v1/models``, ``/health``.
Each response also carries vLLM's token-id fields: ``prompt_token_ids`` and each choice's ``token_ids``.

The episode of a request is its API key (``Authorization: Bearer <key>``, which every OpenAI client sends),
or the ``X-Episode-Id`` header where a client shares one key (or ``X-Session-ID`` when it names a routed episode:
what verifiers' relay sends). Concurrent requests are batched into one engine
call per distinct sampling setting (the engine is used from one thread). Streaming sends the finished
completion as one content chunk (generation is not incremental here), then the finish chunk and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

# The endpoint's own dependencies (the ``openai`` extra: fastapi, uvicorn); imported here, at module level,
# because FastAPI reads the routes' annotations (``request: Request``) from this module's globals.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from shardforge.rollout.openai.protocol import (
    APIError,
    Completion,
    chat_prompt_ids,
    completion_prompt_ids,
    finish,
    now,
    parse_tool_calls,
    response_id,
    sampling_params,
    stop_strings,
    token_logprobs,
)
from shardforge.rollout.openai.recorder import EpisodeRecorder
from shardforge.rollout.types import Rollout, RolloutEngine, SamplingParams

__all__ = ["OpenAIEndpoint"]


@dataclass(slots=True)
class _Pending:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[Any] = field(repr=False)


class _Batcher:
    """Collects the requests that arrive while the engine is busy and sends them as one call per setting."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.pending: list[_Pending] = []
        self.wake = asyncio.Event()
        self.calls = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append(_Pending(prompt_ids, params, future))
        self.wake.set()
        return await future

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            await asyncio.sleep(0)  # requests that arrive in the same loop turn join this batch
            self.wake.clear()
            batch, self.pending = self.pending, []
            groups: dict[SamplingParams, list[_Pending]] = {}
            for item in batch:  # a request's seed stays its own: seeded requests go alone
                groups.setdefault(item.params, []).append(item)
            for params, items in groups.items():
                self.calls += 1
                try:
                    out = await asyncio.to_thread(self.engine.generate, [i.prompt_ids for i in items], params)
                except Exception as exc:  # every waiting request fails with the engine's error (a 500)
                    for item in items:
                        item.future.set_exception(exc)
                    continue
                for k, item in enumerate(items):
                    item.future.set_result(out[k * params.n : (k + 1) * params.n])


class OpenAIEndpoint:
    """The endpoint (a FastAPI app, `app`) and its `EpisodeRecorder`; `start` serves it in a thread."""

    def __init__(
        self,
        engine: RolloutEngine | None,
        tokenizer: Any,
        *,
        model_name: str = "policy",
        max_tokens: int = 1024,
        max_prompt_tokens: int = 32768,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_tokens, self.max_prompt_tokens = max_tokens, max_prompt_tokens
        self.recorder = EpisodeRecorder()
        self._routes: dict[str, Callable[[list[int], int], Awaitable[Rollout]]] = {}
        self.app = self._build_app()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ------------------------------------------------------------------------------------------ the app
    def _build_app(self) -> Any:
        state: dict[str, Any] = {}

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            if self.engine is None:  # routes only (`route`)
                yield
                return
            state["batcher"] = _Batcher(self.engine)
            task = asyncio.create_task(state["batcher"].run())
            yield
            task.cancel()

        app = FastAPI(title="shardforge OpenAI-compatible endpoint", lifespan=lifespan)

        @app.exception_handler(APIError)
        async def _api_error(_: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        async def _body(request: Request) -> dict[str, Any]:
            try:
                body = await request.json()
            except ValueError as exc:
                raise APIError(400, f"the request body is not JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise APIError(400, "the request body must be a JSON object")
            model = body.get("model")
            if model not in (None, self.model_name):
                raise APIError(404, f"model {model!r} does not exist; this endpoint serves {self.model_name!r}",
                               "model", "not_found_error")  # fmt: skip
            return body

        def _episode(request: Request) -> str:
            explicit = request.headers.get("x-episode-id")
            if explicit:
                return explicit
            # verifiers' relay sends one shared key and the rollout's trace id as X-Session-ID: a routed one names
            # the episode (workflow.name: verifiers routes each trace id as it is minted).
            session = request.headers.get("x-session-id")
            if session and session in self._routes:
                return session
            auth = request.headers.get("authorization", "")
            if not auth.lower().startswith("bearer ") or not auth[7:].strip():
                raise APIError(401, "no episode: send an API key (Authorization: Bearer <episode id>) or an "
                               "X-Episode-Id header", kind="authentication_error")  # fmt: skip
            return auth[7:].strip()

        async def _complete(episode: str, prompt_ids: list[int], body: dict[str, Any]) -> list[Completion]:
            if len(prompt_ids) > self.max_prompt_tokens:
                raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; the limit is {self.max_prompt_tokens}",
                               "messages")  # fmt: skip
            params = sampling_params(body, max_tokens_limit=self.max_tokens)
            stops = stop_strings(body)
            route = self._routes.get(episode)
            if route is not None:  # an episode of a trainer's workflow: its request queue samples
                if params.n != 1:
                    raise APIError(400, "n must be 1 here: a training episode samples one continuation per request "
                                   "(the trainer's group_size runs several episodes)", "n")  # fmt: skip
                rollouts = [await route(prompt_ids, params.max_new_tokens)]
            elif self.engine is None:
                raise APIError(401, f"unknown episode {episode!r}: this endpoint serves registered episodes only",
                               kind="authentication_error")  # fmt: skip
            else:
                rollouts = await state["batcher"].generate(prompt_ids, params)
            choices, recorded = [], []
            for rollout in rollouts:
                completion, kept = finish(self.tokenizer, rollout, stops)
                choices.append(completion)
                recorded.append(kept)
            self.recorder.record(episode, prompt_ids, recorded)
            return choices

        def _usage(prompt_ids: list[int], choices: list[Completion]) -> dict[str, int]:
            generated = sum(len(c.ids) for c in choices)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": generated,
                    "total_tokens": len(prompt_ids) + generated}  # fmt: skip

        @app.get("/health")
        async def _health() -> dict[str, Any]:
            return {"status": "ok", "version": self.engine.version if self.engine is not None else None}

        @app.get("/v1/models")
        async def _models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "shardforge"}]}  # fmt: skip

        @app.post("/v1/chat/completions")
        async def _chat(request: Request) -> Any:
            body, episode = await _body(request), _episode(request)
            prompt_ids = chat_prompt_ids(self.tokenizer, body)
            choices = await _complete(episode, prompt_ids, body)
            want_logprobs = bool(body.get("logprobs"))
            out = []
            for index, choice in enumerate(choices):
                content, calls = parse_tool_calls(choice.text) if body.get("tools") else (choice.text, [])
                message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
                if calls:
                    message["tool_calls"] = calls
                out.append({
                    "index": index, "message": message, "token_ids": choice.ids,
                    "finish_reason": "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason,
                    "logprobs": token_logprobs(self.tokenizer, choice) if want_logprobs else None,
                })  # fmt: skip
            response = {
                "id": response_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": out, "usage": _usage(prompt_ids, choices), "prompt_token_ids": prompt_ids,
            }  # fmt: skip
            if body.get("stream"):
                return StreamingResponse(_stream(response), media_type="text/event-stream")
            return response

        @app.post("/v1/completions")
        async def _completions(request: Request) -> Any:
            body, episode = await _body(request), _episode(request)
            if body.get("stream"):
                raise APIError(400, "stream is supported on /v1/chat/completions only", "stream")
            prompt_ids = completion_prompt_ids(self.tokenizer, body)
            choices = await _complete(episode, prompt_ids, body)
            out = []
            for index, choice in enumerate(choices):
                logprobs = None
                if body.get("logprobs") is not None:
                    tokens = [self.tokenizer.decode([t]) for t in choice.ids]
                    logprobs = {"tokens": tokens, "token_logprobs": choice.logprobs, "top_logprobs": None,
                                "text_offset": None}  # fmt: skip
                out.append({"index": index, "text": choice.text, "token_ids": choice.ids, "logprobs": logprobs,
                            "finish_reason": choice.finish_reason})  # fmt: skip
            return {
                "id": response_id("cmpl"), "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": out, "usage": _usage(prompt_ids, choices), "prompt_token_ids": prompt_ids,
            }  # fmt: skip

        return app

    def route(self, episode: str, generate: Callable[[list[int], int], Awaitable[Rollout]]) -> None:
        """Serve ``episode``'s requests with ``generate(prompt_ids, max_new_tokens)`` (a coroutine function run on
        this endpoint's event loop) instead of the engine: how a trainer's workflow puts an agent's requests in
        its own request queue (its sampling settings, seeds and batching). `unroute` when the episode ends."""
        self._routes[episode] = generate

    def unroute(self, episode: str) -> None:
        self._routes.pop(episode, None)

    # --------------------------------------------------------------------------------------- serving
    def start(self, host: str = "127.0.0.1", port: int | None = None, *, timeout_s: float = 30.0) -> OpenAIEndpoint:
        """Serve in a daemon thread; returns when it accepts requests (``url`` ends in ``/v1``)."""
        import time

        import uvicorn

        from shardforge.mesh import free_port

        port = port or free_port(host)
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="openai-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the OpenAI endpoint did not start on {host}:{port} within {timeout_s} s")
            time.sleep(0.02)
        self.url = f"http://{host}:{port}/v1"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None


async def _stream(response: dict[str, Any]) -> AsyncIterator[bytes]:
    """A finished chat completion as OpenAI's chunk stream: role + content (+ tool calls), the finish, [DONE]."""
    base = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for choice in response["choices"]:
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        first = {"index": choice["index"], "delta": delta, "finish_reason": None, "logprobs": choice["logprobs"],
                 "token_ids": choice["token_ids"]}  # fmt: skip
        yield f"data: {json.dumps(base | {'choices': [first], 'prompt_token_ids': response['prompt_token_ids']})}\n\n".encode()
        last = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
        yield f"data: {json.dumps(base | {'choices': [last]})}\n\n".encode()
    yield f"data: {json.dumps(base | {'choices': [], 'usage': response['usage']})}\n\n".encode()
    yield b"data: [DONE]\n\n"
