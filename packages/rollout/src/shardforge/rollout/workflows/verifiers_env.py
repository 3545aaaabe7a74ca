"""``workflow.name: verifiers``: a verifiers 0.4 environment (``verifiers.v1``) produces the GRPO episodes.

    workflow:
      name: verifiers
      verifiers: {env: my_taskset, env_args: {split: train}}   # or env: path/env.py, or env: pkg.mod:load_env

Each data row names its task by its prompt (a row's prompt is a task's ``prompt``). The environment runs the task
as it would under ``vf-eval`` (its harness, its MCP tools, its ``@vf.reward`` functions / judges), but every model
call of its harness goes through the run's OpenAI-compatible endpoint (`agent.shared_endpoint`): verifiers' relay
sends each request with the trace id as ``X-Session-ID``, which this workflow routes into the trainer's request
queue as the trace is minted; the endpoint records every turn token-exact (never re-encoded). The episode's
trajectory is the one the last trace's last turn extended, its reward the trace's reward (the weighted sum of its
rewards). An episode that verifiers marks failed, or that runs past ``timeout_s``, fails only itself (counted).

An environment id or ``.py`` file gets verifiers' `SingleAgentEnv` with its agent seat played by
`verifiers_harness.InProcessChatHarness` in a local subprocess runtime (no container, no network); a
``module:function`` returns any ``verifiers.v1.Env`` (see `verifiers_harness.chat_env`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any

from shardforge.core.registry import import_path
from shardforge.rollout.episodes.request_queue import EpisodeHandle
from shardforge.rollout.episodes.trajectory import Trajectory
from shardforge.rollout.workflows.agent import shared_endpoint
from shardforge.rollout.workflows.base import PromptRow, VerifiersConfig, WorkflowConfig

__all__ = ["VerifiersWorkflow", "load_verifiers_env"]

_API_KEY_VAR = "SHARDFORGE_VERIFIERS_API_KEY"  # unset: verifiers sends "EMPTY"; episodes go by X-Session-ID


def load_verifiers_env(options: VerifiersConfig, max_turns: int = 8) -> Any:
    """The ``verifiers.v1.Env`` that ``workflow.verifiers`` names."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            "workflow.name=verifiers needs the verifiers package: pip install 'shardforge-rollout[verifiers]' "
            "(verifiers==0.4.0, openai<3)"
        ) from exc
    from shardforge.rollout.workflows.verifiers_harness import chat_env

    if not options.env:
        raise ValueError("workflow.name=verifiers needs workflow.verifiers.env: a verifiers taskset id, a taskset "
                         "file 'path/env.py', or 'package.module:function' returning a verifiers.v1.Env")  # fmt: skip
    if ":" in options.env:
        env = import_path(options.env)(**options.env_args)  # type: ignore[operator]
        if not isinstance(env, vf.Env):
            raise TypeError(f"workflow.verifiers.env={options.env!r} returned {type(env).__name__}, not a "
                            "verifiers.v1.Env; build one with shardforge.rollout.workflows.verifiers_harness.chat_env")  # fmt: skip
        return env
    # A file is loaded once under a module name of its own, which verifiers' loader then imports as the taskset id.
    taskset = str(import_path(f"{options.env}:__name__")) if options.env.endswith(".py") else options.env
    return chat_env(taskset, max_turns=max_turns, **options.env_args)


class _ServingLoop:
    """verifiers' serving resources (its interception server, shared tool servers) live on one event loop for the
    workflow's lifetime, in a thread: the trainer runs each step's episodes on a fresh loop."""

    def __init__(self, env: Any, max_concurrent: int) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="verifiers-env", daemon=True).start()
        self.stack = contextlib.AsyncExitStack()
        self.gate: asyncio.Semaphore | None = None
        self.submit(self._enter(env, max_concurrent)).result(timeout=300)
        atexit.register(self.close)  # verifiers' servers and tool subprocesses end before the interpreter does

    def close(self) -> None:
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                self.submit(self.stack.aclose()).result(timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)

    async def _enter(self, env: Any, max_concurrent: int) -> None:
        await self.stack.enter_async_context(env.serving())
        self.gate = asyncio.Semaphore(max_concurrent)

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)


class VerifiersWorkflow:
    """Runs ``workflow.verifiers.env``'s task of each row, its model calls through the endpoint."""

    def __init__(self, config: WorkflowConfig, tokenizer: Any, reward_fn: Any) -> None:
        import verifiers.v1 as vf  # after load_verifiers_env: it names the pip command when this fails

        self.options = options = config.verifiers
        self.env = load_verifiers_env(options, config.max_turns)
        self.tasks: dict[str, Any] = {}
        for task in self.env.taskset:
            self.tasks.setdefault(task.data.prompt_text, task)
        self.endpoint = shared_endpoint(tokenizer, options.model_name, options.max_tokens)
        client = vf.EvalClientConfig(base_url=self.endpoint.url, api_key_var=_API_KEY_VAR)
        self.context = vf.ModelContext(model=options.model_name, client=client)
        self.serving = _ServingLoop(self.env, options.max_concurrent)

    async def run_episode(self, engine: EpisodeHandle, row: PromptRow) -> list[Trajectory]:
        task = self.tasks.get(row.prompt)
        if task is None:
            raise ValueError(f"row {row.index}'s prompt {row.prompt[:80]!r} is no task of {self.options.env!r} "
                             f"({len(self.tasks)} tasks); the train_file's prompts must be the taskset's prompts")  # fmt: skip
        loop = asyncio.get_running_loop()

        async def generate(prompt_ids: list[int], max_new_tokens: int) -> Any:  # runs on the endpoint's loop
            budget = min(max_new_tokens, engine.params.max_new_tokens)
            future = asyncio.run_coroutine_threadsafe(engine.generate(prompt_ids, max_new_tokens=budget), loop)
            return await asyncio.wrap_future(future)

        minted: list[str] = []

        def route(trace: Any) -> None:  # before the trace's first model call
            minted.append(trace.id)
            self.endpoint.route(trace.id, generate)

        try:
            episode = await asyncio.wrap_future(self.serving.submit(self._run(task, route)))
        finally:
            records = {}
            for trace_id in minted:
                self.endpoint.unroute(trace_id)
                records[trace_id] = self.endpoint.recorder.pop(trace_id)
        if not episode.ok or not episode.traces:
            error = episode.errors[-1] if episode.errors else None
            detail = f"{error.type}: {error.message}" if error else "no trace"
            raise RuntimeError(f"the verifiers episode of row {row.index} failed ({detail})")
        trace = episode.traces[-1]
        record = records.get(trace.id)
        if record is None or not record.trajectories:
            raise RuntimeError(f"the verifiers episode of row {row.index} made no request to the endpoint")
        trajectory = record.trajectories[-1]
        trajectory.group, trajectory.images = row.index, row.images
        trajectory.reward = float(trace.reward)
        trajectory.stop_reason = f"verifiers_rewrites_{record.rewrites}" if record.rewrites else "verifiers"
        return [trajectory]

    async def _run(self, task: Any, route: Any) -> Any:  # on the serving loop
        assert self.serving.gate is not None
        async with self.serving.gate:
            try:
                return await asyncio.wait_for(
                    self.env.run_episode(task, self.context, on_trace=route), timeout=self.options.timeout_s
                )
            except TimeoutError as exc:
                raise RuntimeError(
                    f"the episode ran past workflow.verifiers.timeout_s={self.options.timeout_s}"
                ) from exc
