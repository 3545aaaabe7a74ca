"""Reward functions in a pool of Ray actors: ``reward.ray_workers: N`` under ``--launcher ray``.

The Ray launcher starts ``N`` `RewardActor`s (one CPU bundle each, in the ranks' placement group) and gives
every rank their names (`REWARD_ACTORS_ENV`). A rank's `RayPooledReward` registers its reward function with
every actor once, then scores a batch by splitting it into ``N`` contiguous chunks (`split_evenly`), one per
actor (the first actor rotating from call to call), all in flight at once, and concatenating the results in order.
The trainers hand it each round's rewards of the whole step as one batch (`rollout.reward_batch`: every episode's
``(prompt, response, reference)``), so the chunks of a step are scored concurrently. Each actor runs the function behind
the same `GuardedReward` (timeout, concurrency limit, error policy) as the in-process path, so the rewards
are the ones the in-process run computes; each chunk's counts (``reward/calls|failures|...``, and the
function's own, e.g. math-verify's) come back with it and add up in `pop_stats`.

The reward function travels to the actors pickled (cloudpickle): a function of a user module is pickled by
reference, so that module must be importable on every Ray node, as it already is for the ranks, which load
``reward_fn`` by name. The pure part (names, refusals, splitting, merging) needs no Ray.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardforge.rewards.guarded import GuardedReward, RewardConfig, RewardError

__all__ = [
    "REWARD_ACTORS_ENV",
    "RayPooledReward",
    "RewardActor",
    "actor_names_from_env",
    "merge_stats",
    "reward_actor_names",
    "reward_actor_names_from_env",
    "reward_workers_for_launcher",
    "split_evenly",
]

REWARD_ACTORS_ENV = "SHARDFORGE_RAY_REWARD_ACTORS"
"""Set by the Ray launcher on every rank: the reward actors' names, comma-separated."""

_HOW = "docs/multinode.md, 'Reward workers'"


def reward_actor_names(num_workers: int, prefix: str = "shardforge-reward") -> list[str]:
    """The Ray names of ``num_workers`` reward actors."""
    return [f"{prefix}-{index}" for index in range(num_workers)]


def reward_workers_for_launcher(config: Any, launcher: str) -> int:
    """``config.reward.ray_workers`` (0: rewards in the trainer process); a `ValueError` when it asks for Ray
    workers but ``launcher`` (the CLI's ``--launcher``, or ``"external"``) is not ``ray``."""
    workers = int(getattr(getattr(config, "reward", None), "ray_workers", 0))
    if workers > 0 and launcher != "ray":
        raise ValueError(
            f"reward.ray_workers={workers} scores rewards in Ray actors, which only --launcher ray starts (this "
            f"run's launcher: {launcher}): add --launcher ray, or set reward.ray_workers=0 to score in the "
            f"trainer process ({_HOW})"
        )
    return workers


def reward_actor_names_from_env(num_workers: int, env: Mapping[str, str] | None = None) -> list[str]:
    """The reward actors the Ray launcher started (`REWARD_ACTORS_ENV`); a `ValueError` when this rank was not
    started by ``--launcher ray`` with ``reward.ray_workers``, or with another count."""
    return actor_names_from_env(
        REWARD_ACTORS_ENV,
        num_workers,
        kind="reward",
        needs=f"reward.ray_workers={num_workers}",
        instead=f"reward.ray_workers=0 ({_HOW})",
        env=env,
    )


def split_evenly(num_items: int, num_workers: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each worker's contiguous chunk: sizes differ by at most one, the larger first;
    empty chunks are left out (fewer items than workers)."""
    if num_workers < 1 or num_items < 0:
        raise ValueError(f"num_items={num_items} and num_workers={num_workers} must be >= 0 and >= 1")
    size, extra = divmod(num_items, num_workers)
    bounds, start = [], 0
    for index in range(num_workers):
        stop = start + size + (1 if index < extra else 0)
        if stop > start:
            bounds.append((start, stop))
        start = stop
    return bounds


def merge_stats(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Counts of several chunks added key by key."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + float(value)
    return out


class RewardActor:
    """One reward worker (wrapped with ``ray.remote`` by the launcher): each rank registers its function once."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.rewards: dict[str, GuardedReward] = {}
        self.scored = 0

    def register(self, key: str, fn: Callable[..., Any], config: RewardConfig, name: str) -> list[str]:
        """Keep ``fn`` for ``key``'s calls; return the names of its counts (all zero so far)."""
        self.rewards[key] = GuardedReward(fn, config, name=name)
        return sorted(self.rewards[key].pop_stats())

    def score(self, key: str, items: list[tuple[str, str, str]]) -> tuple[list[float | RewardError], dict[str, float]]:
        """Rewards of ``items`` in order (an item that failed under ``on_error: raise``: its `RewardError`,
        `GuardedReward.score_outcomes`), and the counts of this call (`GuardedReward.pop_stats`)."""
        reward = self.rewards[key]
        values = reward.score_outcomes(items)
        self.scored += len(items)
        return values, reward.pop_stats()

    def stats(self) -> dict[str, int]:
        return {"index": self.index, "scored": self.scored, "callers": len(self.rewards)}


class RayPooledReward:
    """A rank's reward function whose calls run on the reward actors (see the module docstring).

    Args:
        fn: the reward function (``build_reward``'s result), pickled once to every actor.
        config: the ``reward:`` settings each actor applies (``ray_workers`` itself is not used there).
        names: the actors' Ray names (`reward_actor_names_from_env`).
        handles, get: the actors and ``ray.get`` (tests pass stand-ins; None: looked up with Ray).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        config: RewardConfig,
        names: Sequence[str],
        *,
        name: str | None = None,
        handles: Sequence[Any] | None = None,
        get: Callable[[Any], Any] | None = None,
    ) -> None:
        if handles is None or get is None:
            import ray

            handles = [ray.get_actor(actor) for actor in names] if handles is None else handles
            get = ray.get if get is None else get
        self.names, self.handles, self._get = list(names), list(handles), get
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.key = uuid.uuid4().hex  # this rank's function on the shared actors
        self._stats: list[dict[str, float]] = []
        self._start = 0
        refs = [handle.register.remote(self.key, fn, config, self.name) for handle in self.handles]
        # every count's name, as the in-process `GuardedReward.pop_stats` gives them (zeros included): the ranks
        # sum them key by key, so a rank whose step scored nothing must still report every key
        self._keys = sorted({key for index, ref in enumerate(refs) for key in self._call(index, ref)})

    def _call(self, index: int, ref: Any) -> Any:
        try:
            return self._get(ref)
        except RewardError:
            raise
        except Exception as exc:
            cause = getattr(exc, "as_instanceof_cause", None)
            if cause is not None and isinstance(cause(), RewardError):  # on_error=raise inside the actor
                raise RewardError(str(cause())) from exc
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            raise RewardError(f"reward actor {self.names[index]} failed: {first}") from exc

    def __call__(self, prompt: str, response: str, reference: str) -> float:
        return self.score_many([(prompt, response, reference)])[0]

    def score_many(self, items: Sequence[tuple[str, str, str]]) -> list[float]:
        """Rewards of ``items`` in order: one contiguous chunk per actor, all in flight at once; raises the first
        item's `RewardError` (``on_error: raise``) or a failed actor's."""
        values = self.score_outcomes(items)
        for value in values:
            if isinstance(value, RewardError):
                raise value
        return values  # type: ignore[return-value]

    def score_outcomes(self, items: Sequence[tuple[str, str, str]]) -> list[float | RewardError]:
        """As `score_many`, but each item's `RewardError` in its place (`GuardedReward.score_outcomes`); the items of
        a chunk whose actor failed all get that actor's error. A trainer step's rewards come here as one batch
        (`rollout.reward_batch`), so the actors score its chunks concurrently."""
        items = [tuple(item) for item in items]  # type: ignore[misc]
        bounds = split_evenly(len(items), len(self.handles))
        # chunk i goes to actor (start + i): the start rotates, so one-item calls (a workflow scoring its
        # rollouts one by one) are spread over the actors too
        actors = [(self._start + i) % len(self.handles) for i in range(len(bounds))]
        self._start = (self._start + len(bounds)) % len(self.handles)
        refs = [self.handles[i].score.remote(self.key, items[a:b]) for i, (a, b) in zip(actors, bounds, strict=True)]
        values: list[float | RewardError] = []
        for index, ref, (a, b) in zip(actors, refs, bounds, strict=True):
            try:
                chunk, stats = self._call(index, ref)
            except RewardError as error:
                values.extend([error] * (b - a))
                continue
            if len(chunk) != b - a:
                raise RewardError(f"reward actor {self.names[index]} returned {len(chunk)} rewards for {b - a} items")
            values.extend(v if isinstance(v, RewardError) else float(v) for v in chunk)
            self._stats.append(stats)
        return values

    def pop_stats(self) -> dict[str, float]:
        """The counts of every chunk scored since the last call, added up (as `GuardedReward.pop_stats`)."""
        parts, self._stats = self._stats, []
        return dict.fromkeys(self._keys, 0.0) | merge_stats(parts)

    def close(self) -> None:
        """Nothing to stop here: the launcher kills the actors at the end of the run."""


def actor_names_from_env(
    variable: str, count: int, *, kind: str, needs: str, instead: str, env: Mapping[str, str] | None = None
) -> list[str]:
    """The ``kind`` actors (comma-separated names in ``variable``) the Ray launcher started for ``needs``; a
    `ValueError` naming ``instead`` when the variable is unset (another launcher), or with another count."""
    value = (os.environ if env is None else env).get(variable, "")
    names = [name for name in value.split(",") if name]
    if not names:
        raise ValueError(
            f"{needs} needs the {kind} actors that `shardforge train ... --launcher ray` starts ({variable} is "
            f"not set: this rank was started by another launcher); use --launcher ray, or {instead}"
        )
    if len(names) != count:
        raise ValueError(f"the launcher started {len(names)} {kind} actors ({value}), the config asks for {count}")
    return names
