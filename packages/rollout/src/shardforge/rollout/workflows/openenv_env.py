"""``workflow.name: openenv``: an OpenEnv environment server (``openenv-core`` 0.3) is the environment; the policy's
replies are its actions, its step rewards the episode's reward.

    workflow:
      name: openenv
      chat_template: true
      max_turns: 4
      openenv: {app: examples/agents/openenv_guess_env.py:app, action_field: message, observation_field: prompt}

Each episode opens a session on the server with openenv's own client (`openenv.core.GenericEnvClient`: a WebSocket
session on ``/ws``, the server's environment instance per session; its stateless HTTP ``/reset`` and ``/step``
cannot hold an episode) and resets it with the row's ``prompt``, ``reference`` and its group's ``seed`` (plus
``reset_args``; the server passes on what the environment's ``reset`` accepts), so a group's samples face the same
task. Then, up to ``max_turns``: the observation's ``observation_field`` text is the user turn (at reset: the row's
prompt when the observation has none), the engine generates the reply, and the reply (after any ``</think>``) is the
step's action ``{action_field: reply}``; the episode ends when the environment says ``done``.

Token-in / token-out as `multi_turn`: the trajectory is the prompt ids, the generated ids as the engine sampled them
and each observation's continuation ids (`ChatCodec`, loss-masked); nothing is re-encoded. The reward is the sum (or
``reward: last``, the last) of the step rewards (None counts 0); the run's ``reward_fn`` is not called.

The server is ``url`` (running elsewhere) or ``app``: an ASGI app (openenv's ``create_app(...)``) served by uvicorn
in ``num_servers`` local subprocesses (`openenv_servers.LocalServers`). A server that dies fails only the episodes
it was serving (the connection drops; counted against ``workflow.max_failed_fraction``); the next episode that
needs it starts it again.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from shardforge.rollout.episodes.request_queue import EpisodeHandle
from shardforge.rollout.episodes.trajectory import Trajectory, TurnInfo
from shardforge.rollout.workflows.base import OpenEnvConfig, PromptRow, WorkflowConfig, new_trajectory
from shardforge.rollout.workflows.chat import ChatCodec

__all__ = ["OpenEnvWorkflow"]

_PIP = "pip install 'shardforge-rollout[openenv]' (openenv-core==0.3.0; docs/agents-openai.md)"


def _client_class() -> Any:
    try:
        from openenv.core import GenericEnvClient
    except ImportError as exc:
        raise ImportError(f"workflow.name=openenv needs the openenv-core package: {_PIP}") from exc
    return GenericEnvClient


class OpenEnvWorkflow:
    """Runs each row's episodes on an OpenEnv server, the model's replies as the actions."""

    def __init__(self, config: WorkflowConfig, tokenizer: Any, reward_fn: Any) -> None:
        options: OpenEnvConfig = config.openenv
        if not options.url and not options.app:
            raise ValueError("workflow.name=openenv needs workflow.openenv.url (a running OpenEnv server) or "
                             "workflow.openenv.app (its ASGI app 'package.module:app' or 'path/file.py:app', "
                             "served in local subprocesses)")  # fmt: skip
        self.client_class = _client_class()
        self.config, self.options, self.tokenizer = config, options, tokenizer
        self.codec = ChatCodec(tokenizer, chat_template=config.chat_template, system_prompt=config.system_prompt)
        self.servers: Any = None
        if options.app:
            from shardforge.rollout.workflows.openenv_servers import LocalServers

            self.servers = LocalServers(options.app, options.num_servers, options.startup_timeout_s)

    def close(self) -> None:
        """Stop the local servers (a ``url`` server keeps running)."""
        if self.servers is not None:
            self.servers.close()

    async def _url(self, row: PromptRow) -> str:
        if self.servers is None:
            return self.options.url
        return str(await asyncio.to_thread(self.servers.url, row.index % self.options.num_servers))

    async def run_episode(self, engine: EpisodeHandle, row: PromptRow) -> list[Trajectory]:
        url = await self._url(row)
        try:
            return await asyncio.wait_for(self._episode(engine, row, url), timeout=self.options.timeout_s)
        except TimeoutError as exc:
            raise RuntimeError(
                f"the OpenEnv episode of row {row.index} ran past workflow.openenv.timeout_s={self.options.timeout_s}"
            ) from exc

    async def _episode(self, engine: EpisodeHandle, row: PromptRow, url: str) -> list[Trajectory]:
        config, options = self.config, self.options
        reset_args: dict[str, Any] = {"prompt": row.prompt, "reference": row.reference, **options.reset_args}
        if row.seed is not None:
            reset_args.setdefault("seed", row.seed)
        client = self.client_class(base_url=url, connect_timeout_s=min(30.0, options.timeout_s),
                                   message_timeout_s=options.timeout_s)  # fmt: skip
        async with client as env:
            try:
                result = await env.reset(**reset_args)
            except Exception as exc:
                raise RuntimeError(f"the OpenEnv server at {url} failed the reset of row {row.index}: {exc!r}") from exc
            first = self._text(result.observation, required=False) or row.prompt
            if first == row.prompt:
                prompt_ids = self.codec.prompt_ids(row.prompt, row.prompt_ids, rendered=row.images is not None)
            else:
                prompt_ids = self.codec.prompt_ids(first, self.codec._encode(first))
            trajectory = new_trajectory(row, prompt_ids)
            trajectory.stop_reason, trajectory.reward = "max_turns", 0.0
            rewards: list[float] = []
            for turn in range(config.max_turns):
                budget = config.max_total_tokens
                if budget is not None and len(trajectory.token_ids) + engine.params.max_new_tokens > budget:
                    trajectory.stop_reason = "max_tokens"
                    break
                out = await engine.generate(trajectory.token_ids)
                trajectory.append(out.response_ids, logprobs=out.logprobs, version=out.versions,
                                  routing=out.routed_experts)  # fmt: skip
                trajectory.text = out.text
                reply = out.text.split("</think>")[-1].strip()
                try:
                    result = await env.step({options.action_field: reply})
                except Exception as exc:
                    raise RuntimeError(f"the OpenEnv server at {url} failed step {turn} of row {row.index}: "
                                       f"{exc!r}") from exc  # fmt: skip
                reward = 0.0 if result.reward is None else float(result.reward)
                rewards.append(reward)
                trajectory.turns.append(TurnInfo(generated=len(out.response_ids), finished=out.finished, reward=reward))
                if result.done:
                    trajectory.stop_reason = "done"
                    break
                if turn == config.max_turns - 1:
                    break
                message = {"role": "user", "content": self._text(result.observation, required=True)}
                trajectory.append(self.codec.continuation_ids([message], finished=out.finished))
        if rewards:
            trajectory.reward = sum(rewards) if options.reward == "sum" else rewards[-1]
        return [trajectory]

    def _text(self, observation: Any, *, required: bool) -> str:
        """The observation's ``observation_field`` as text (a non-string value as JSON)."""
        field = self.options.observation_field
        if not isinstance(observation, dict) or field not in observation:
            if not required:
                return ""
            keys = sorted(observation) if isinstance(observation, dict) else type(observation).__name__
            raise ValueError(f"the OpenEnv observation has no field {field!r} (workflow.openenv.observation_field); "
                             f"its fields: {keys}")  # fmt: skip
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
