"""Many concurrent episodes, one rollout engine: a request queue that batches their generate calls.

Every episode runs as an asyncio task and asks for one continuation at a time
(``await handle.generate(token_ids)``). The queue holds the requests and sends them to the engine
as ONE batched ``generate`` call as soon as every live episode is waiting on it (an episode that
is running a tool is not waiting yet; an episode that ended no longer counts). So 32 three-turn
episodes cost about three batched ``generate`` calls instead of 96 single ones.

Rounds, not timers, decide the batches: round r holds the requests of every episode still alive
at its r-th generation, in episode order. Each request carries its own seed (`rollout.seeds`): its
episode's seed at the episode's first generation, ``request_seed(episode seed, t)`` at its t-th
(t >= 1). Which samples an episode gets therefore depends neither on how long a tool took, on thread
timing, nor on which other episodes share its call: runs are reproducible, resumable and the same
under every data-parallel layout when the caller names episodes by what they are (the trainers: the
prompt's position in the step's global batch). With no episode seeds, round r has one call seed
derived from (``params.seed``, r) (None: unseeded).

Rewards are batched the same way: an episode that asks for a reward (``await handle.score(reward_fn, prompt,
response, reference)``) waits too, and once every live episode waits (on a reward or a generation) the waiting
rewards go to the reward function as ONE batch (`rollout.reward_batch.score_outcomes`), before any generation: a
step of single-turn episodes makes one generate call and one reward call, so `GuardedReward` scores the batch on
its threads and ``reward.ray_workers`` spreads it over the Ray reward actors. Generation rounds are unchanged (a
round still waits for every live episode). Each request gets its own outcome: a failed item fails its episode only.

Engines that keep per-session state (`SessionRolloutEngine`: the embedded HF engine's KV cache across
turns) get each request's episode as its session key, and `end_sessions` when the episode ends. (An engine
whose ``generate`` was replaced by a wrapper without ``sessions`` / ``**kwargs`` is called without them.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardforge.rewards.batch import RewardItem, score_outcomes
from shardforge.rollout.seeds import request_seed
from shardforge.rollout.types import (
    ImageInputs,
    Rollout,
    RolloutEngine,
    SamplingParams,
    SessionRolloutEngine,
    generate_rollouts,
)

__all__ = ["EpisodeHandle", "RequestQueue"]

_QUEUE_IDS = itertools.count()


@dataclass(slots=True)
class _Request:
    episode: int
    prompt_ids: list[int]
    max_new_tokens: int
    future: asyncio.Future[Rollout]
    images: ImageInputs | None = None


@dataclass(slots=True)
class _RewardRequest:
    episode: int
    reward_fn: Callable[..., Any]
    item: RewardItem
    future: asyncio.Future[Any]


class EpisodeHandle:
    """What a workflow's episode sees of the rollout engine: ``await generate(token_ids)``.

    An episode of an image prompt generates with the prompt's images (`ImageInputs`) in every turn: its
    token ids always start with the prompt, image tokens included, so workflows need not pass them."""

    def __init__(self, queue: RequestQueue, episode: int, images: ImageInputs | None = None) -> None:
        self.queue, self.episode, self.images = queue, episode, images

    @property
    def params(self) -> SamplingParams:
        """The sampling parameters of this batch (``max_new_tokens`` = the per-turn budget)."""
        return self.queue.params

    async def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int | None = None) -> Rollout:
        """One sampled continuation of ``prompt_ids`` (token ids in, token ids + log-probs out)."""
        budget = max_new_tokens or self.queue.params.max_new_tokens
        return await self.queue.submit(self.episode, prompt_ids, budget, images=self.images)

    async def score(self, reward_fn: Callable[..., Any], prompt: str, response: str, reference: str) -> Any:
        """``reward_fn(prompt, response, reference)``, scored in one batch with the other episodes' rewards
        (raises what scoring this item raised; the value is returned unchecked)."""
        return await self.queue.submit_reward(self.episode, reward_fn, (prompt, response, reference))


class RequestQueue:
    """Batches the generate requests of concurrent episodes into round-wise engine calls.

    Args:
        engine: any `RolloutEngine` (its ``generate`` takes token-id prompts).
        params: sampling parameters; ``n`` must be 1 (a group is ``n`` episodes), ``seed`` seeds round 0
            (when there are no ``episode_seeds``).
        episode_seeds: episode id -> the seed of its first generation (later ones derive from it); each request
            then samples the same in whichever call it lands.
    """

    def __init__(
        self, engine: RolloutEngine, params: SamplingParams, episode_seeds: Sequence[int] | None = None
    ) -> None:
        if params.n != 1:
            raise ValueError(f"RequestQueue samples one continuation per request; got n={params.n} (run n episodes)")
        self.engine, self.params = engine, params
        self._sessions = engine if isinstance(engine, SessionRolloutEngine) and _takes_sessions(engine) else None
        self._id = next(_QUEUE_IDS)  # session keys (queue, episode) stay distinct across queues on one engine
        self.episode_seeds = episode_seeds
        self._turns: dict[int, int] = {}
        self._pending: list[_Request] = []
        self._rewards: list[_RewardRequest] = []
        self._live: set[int] = set()
        self.rounds = 0
        """Batched engine calls made so far (one per round and distinct ``max_new_tokens``)."""
        self.generate_calls = 0
        self.reward_calls = 0
        """Batched reward calls made so far (one per reward round and distinct reward function)."""

    def reserve(self, episodes: Sequence[int]) -> None:
        """Count ``episodes`` as live before any of them starts (else the first request would be sent alone)."""
        self._live.update(episodes)

    @contextlib.asynccontextmanager
    async def episode(self, episode: int, images: ImageInputs | None = None) -> AsyncIterator[EpisodeHandle]:
        """A live episode for the duration of the block: its requests are sent in rounds (with ``images``, its
        prompt's); on exit it no longer holds a round back."""
        self._live.add(episode)
        try:
            yield EpisodeHandle(self, episode, images)
        finally:
            self._live.discard(episode)
            if self._sessions is not None:
                self._sessions.end_sessions([(self._id, episode)])
            self._maybe_flush()

    async def submit(
        self, episode: int, prompt_ids: Sequence[int], max_new_tokens: int, *, images: ImageInputs | None = None
    ) -> Rollout:
        if episode not in self._live:
            raise RuntimeError(f"episode {episode} generates outside `async with queue.episode({episode})`")
        future: asyncio.Future[Rollout] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(episode, list(prompt_ids), max_new_tokens, future, images))
        self._maybe_flush()
        return await future

    async def submit_reward(self, episode: int, reward_fn: Callable[..., Any], item: RewardItem) -> Any:
        if episode not in self._live:
            raise RuntimeError(f"episode {episode} scores outside `async with queue.episode({episode})`")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._rewards.append(_RewardRequest(episode, reward_fn, tuple(item), future))  # type: ignore[arg-type]
        self._maybe_flush()
        return await future

    def _maybe_flush(self) -> None:
        if len(self._pending) + len(self._rewards) < max(len(self._live), 1):
            return
        if self._rewards:  # rewards first: the scored episodes then generate (or end) and complete the round
            self._flush_rewards()
            return
        self._flush_generate()

    def _flush_rewards(self) -> None:
        requests = sorted(self._rewards, key=lambda r: r.episode)
        self._rewards = []
        functions: dict[int, Callable[..., Any]] = {}
        for r in requests:
            functions.setdefault(id(r.reward_fn), r.reward_fn)
        for key, reward_fn in functions.items():
            batch = [r for r in requests if id(r.reward_fn) == key]
            self.reward_calls += 1
            try:
                outcomes = score_outcomes(reward_fn, [r.item for r in batch])
            except Exception as error:  # the source itself failed (not one item): every waiting episode fails
                outcomes = [error] * len(batch)
            for r, outcome in zip(batch, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    r.future.set_exception(outcome)
                else:
                    r.future.set_result(outcome)

    def _flush_generate(self) -> None:
        if not self._pending:
            return
        requests = sorted(self._pending, key=lambda r: r.episode)
        self._pending = []
        seed = self.params.seed
        if seed is not None and self.rounds:
            seed = (seed * 1_000_003 + self.rounds) % (2**63)
        self.rounds += 1
        seeds = {}
        for r in requests:
            turn = self._turns[r.episode] = self._turns.get(r.episode, -1) + 1
            if self.episode_seeds is not None:
                first = self.episode_seeds[r.episode]
                seeds[r.episode] = first if turn == 0 else request_seed(first, turn)
        for budget in sorted({r.max_new_tokens for r in requests}):
            batch = [r for r in requests if r.max_new_tokens == budget]
            params = dataclasses.replace(self.params, max_new_tokens=budget, seed=seed)
            if self.episode_seeds is not None:
                params = dataclasses.replace(params, seeds=tuple(seeds[r.episode] for r in batch))
            try:
                self.generate_calls += 1
                prompts, images = [r.prompt_ids for r in batch], [r.images for r in batch]
                if self._sessions is not None and all(i is None for i in images):
                    outputs = self._sessions.generate(prompts, params, sessions=[(self._id, r.episode) for r in batch])
                else:  # image prompts: the engine re-encodes them every call (no sessions)
                    outputs = generate_rollouts(self.engine, prompts, params, images)
            except Exception as error:  # every waiting episode fails with the engine's error
                for r in batch:
                    r.future.set_exception(error)
                continue
            for r, out in zip(batch, outputs, strict=True):
                r.future.set_result(out)


def _takes_sessions(engine: SessionRolloutEngine) -> bool:
    try:
        parameters = inspect.signature(engine.generate).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "sessions" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
