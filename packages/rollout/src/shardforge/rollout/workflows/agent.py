"""``workflow.name: agent``: train an agent written against the OpenAI client, not against shardforge.

    # my_agent.py: no shardforge import
    async def run(client: openai.AsyncOpenAI, row: dict) -> float | None:
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user",
                                                     "content": row["prompt"]}])
        return float(reply.choices[0].message.content.strip() == row["reference"])

Every episode gets its own API key on one OpenAI-compatible endpoint per process (`shardforge.rollout.openai`):
the endpoint puts the episode's requests into the trainer's request queue (the trainer's sampling settings,
per-episode seeds, batching with the other episodes; a request's ``max_tokens`` is capped by the trainer's
``max_new_tokens``, its temperature is the trainer's) and records every turn token-exact. The agent returns the
episode's reward, or None to have the run's reward function score the last completion against the row's
reference. An agent that raises or runs past ``workflow.agent.timeout_s`` fails its episode only (a crashed
episode, counted against ``workflow.max_failed_fraction``).

Or an external program per episode (``workflow.agent.command: [python, my_agent.py]``, any language): it gets
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (the episode's key) in its environment and the row as JSON on stdin,
and prints its reward as its last line (``null`` for the reward function); a non-zero exit fails the episode.

The episode's trajectory is the one its last turn extended (turns merged without re-tokenisation). A turn that
did not extend the previous one (the agent rewrote or truncated its history, or a completion cut at
``max_tokens`` was sent back closed) starts another trajectory: the earlier ones are dropped and counted in
the episode's ``stop_reason`` (``agent_rewrites_<k>``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import ssl
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from shardforge.core.registry import import_path
from shardforge.rollout.episodes.request_queue import EpisodeHandle
from shardforge.rollout.episodes.trajectory import Trajectory
from shardforge.rollout.workflows.base import PromptRow, WorkflowConfig, score_in_batch

__all__ = ["AgentWorkflow", "shared_endpoint"]

_ENDPOINTS: dict[int, Any] = {}
_LOCK = threading.Lock()
_COUNTER = itertools.count()
_TLS: ssl.SSLContext | None = None


def _http_client(openai: Any) -> Any:
    """openai's default HTTP client with this process's one TLS context: httpx builds (and loads the CA store into)
    a new one per client otherwise, ~40 ms per step of a run, for an endpoint on plain HTTP."""
    global _TLS
    with _LOCK:
        if _TLS is None:
            _TLS = ssl.create_default_context()
    return openai.DefaultAsyncHttpxClient(verify=_TLS)


def shared_endpoint(tokenizer: Any, model_name: str, max_tokens: int) -> Any:
    """This process's routes-only endpoint for ``tokenizer`` (started on first use)."""
    from shardforge.rollout.openai import OpenAIEndpoint

    with _LOCK:
        endpoint = _ENDPOINTS.get(id(tokenizer))
        if endpoint is None:
            endpoint = OpenAIEndpoint(None, tokenizer, model_name=model_name, max_tokens=max_tokens).start()
            _ENDPOINTS[id(tokenizer)] = endpoint
        return endpoint


class AgentWorkflow:
    """Runs the user's agent (``workflow.agent.run``) per episode against the endpoint."""

    def __init__(self, config: WorkflowConfig, tokenizer: Any, reward_fn: Any) -> None:
        options = config.agent
        if not options.run and not options.command:
            raise ValueError("workflow.name=agent needs workflow.agent.run: 'package.module:function', an "
                             "`async def run(client: openai.AsyncOpenAI, row: dict) -> float | None`, or "
                             "workflow.agent.command: [program, args...]")  # fmt: skip
        if options.command:
            self.run: Callable[..., Awaitable[float | None]] = self._run_command
        else:
            run = import_path(options.run)
            if not callable(run) or not asyncio.iscoroutinefunction(run):
                raise ValueError(f"workflow.agent.run={options.run!r} must be an `async def` function (client, row)")
            self.run = run
        self.options, self.tokenizer, self.reward_fn = options, tokenizer, reward_fn
        self.endpoint = shared_endpoint(tokenizer, options.model_name, options.max_tokens)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()

    async def run_episode(self, engine: EpisodeHandle, row: PromptRow) -> list[Trajectory]:
        import openai

        loop = asyncio.get_running_loop()
        key = f"agent-{next(_COUNTER)}-{uuid.uuid4().hex[:8]}"

        async def generate(prompt_ids: list[int], max_new_tokens: int) -> Any:  # runs on the endpoint's loop
            budget = min(max_new_tokens, engine.params.max_new_tokens)
            future = asyncio.run_coroutine_threadsafe(engine.generate(prompt_ids, max_new_tokens=budget), loop)
            return await asyncio.wrap_future(future)

        self.endpoint.route(key, generate)
        base = self._clients.get(loop)
        if base is None:  # one client per event loop (the trainer runs each step on a new one); a copy costs 0.3 ms
            base = self._clients[loop] = openai.AsyncOpenAI(base_url=self.endpoint.url, api_key="-", max_retries=0,
                                                            http_client=_http_client(openai))  # fmt: skip
        # An HTTP connection pool per episode: one shared by 64 concurrent episodes is scanned (a poll per
        # connection) on every request and response, O(episodes^2) per round; a pool of its own costs 0.3 ms.
        http = _http_client(openai)
        client = base.with_options(api_key=key, http_client=http)
        try:
            item = {"prompt": row.prompt, "reference": row.reference, "index": row.index}
            try:
                reward = await asyncio.wait_for(self.run(client, item), timeout=self.options.timeout_s)
            except TimeoutError as exc:
                raise RuntimeError(f"the agent ran past workflow.agent.timeout_s={self.options.timeout_s}") from exc
        finally:
            self.endpoint.unroute(key)
            record = self.endpoint.recorder.pop(key)
            await http.aclose()
        if not record.trajectories:
            who = self.options.run or " ".join(self.options.command)
            raise RuntimeError(f"the agent ({who}) made no request to the endpoint in its episode")
        trajectory = record.trajectories[-1]
        trajectory.group, trajectory.images = row.index, row.images
        if reward is None:
            reward = await score_in_batch(engine, self.reward_fn, row, trajectory.text)
        trajectory.reward = float(reward)
        trajectory.stop_reason = f"agent_rewrites_{record.rewrites}" if record.rewrites else "agent"
        return [trajectory]

    async def _run_command(self, client: Any, row: dict[str, Any]) -> float | None:
        """The external agent of ``workflow.agent.command`` for one episode (``client`` carries its key)."""
        payload = json.dumps(row)
        env = dict(os.environ, OPENAI_BASE_URL=self.endpoint.url, OPENAI_API_KEY=client.api_key, SHARDFORGE_ROW=payload)
        try:
            process = await asyncio.create_subprocess_exec(
                *self.options.command, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        except OSError as exc:
            raise RuntimeError(f"workflow.agent.command={list(self.options.command)} could not start: {exc}") from exc
        try:
            stdout, stderr = await process.communicate(payload.encode())
        except asyncio.CancelledError:  # the episode timed out: the program goes with it
            process.kill()
            await process.wait()
            raise
        if process.returncode:
            tail = stderr.decode(errors="replace").strip()[-1000:]
            raise RuntimeError(f"the agent command exited with {process.returncode}: {tail}")
        lines = [line.strip() for line in stdout.decode(errors="replace").splitlines() if line.strip()]
        if not lines or lines[-1] in ("null", "None"):
            return None
        try:
            reward = float(lines[-1])
        except ValueError as exc:
            raise RuntimeError(
                f"the agent command's last line must be its reward (a number) or null, got {lines[-1][:200]!r}"
            ) from exc
        if not math.isfinite(reward):
            raise RuntimeError(f"the agent command's reward {reward} is not finite")
        return reward
