"""One batch of reward items, each with its own outcome: how a `RequestQueue` scores a round of episodes.

The RL trainers' episodes ask for their rewards with ``await handle.score(...)`` (`workflows.base.score_in_batch`);
the queue gathers the requests of every live episode and hands them to the reward source at once
(`score_outcomes`), so `GuardedReward` runs them on its ``max_concurrency`` threads and `RayPooledReward`
(``reward.ray_workers``) spreads them over its actors, all chunks in flight together. A failing item fails only
its own episode, as when each episode called the function itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RewardItem", "score_outcomes"]

RewardItem = tuple[str, str, str]
"""``(prompt, response, reference)``."""


def score_outcomes(reward_fn: Callable[..., Any], items: Sequence[RewardItem]) -> list[float | Exception]:
    """The reward of each of ``items``, in order, or the exception that item's scoring raised.

    ``reward_fn.score_outcomes`` when it has one (`GuardedReward`, `RayPooledReward`: per-item outcomes, errors under
    ``on_error: raise`` included); else ``reward_fn.score_many`` (a user's batch scorer: an exception fails every
    item); else one call per item, in order (a plain function: the calls it got when each episode scored itself).
    Values come back as they are (the caller checks they are finite numbers)."""
    if not items:
        return []
    outcomes = getattr(reward_fn, "score_outcomes", None)
    if callable(outcomes):
        return _checked(list(outcomes(list(items))), len(items))
    many = getattr(reward_fn, "score_many", None)
    if callable(many):
        try:
            return _checked(list(many(list(items))), len(items))
        except Exception as exc:
            return [exc] * len(items)
    out: list[float | Exception] = []
    for item in items:
        try:
            out.append(reward_fn(*item))
        except Exception as exc:
            out.append(exc)
    return out


def _checked(values: list[Any], count: int) -> list[Any]:
    if len(values) != count:
        error = ValueError(f"the reward function's batch call returned {len(values)} rewards for {count} items")
        return [error] * count
    return values
