"""Reward composition: a weighted sum of reward functions from YAML, each with its own arguments.

.. code-block:: yaml

    rewards:
      - {name: math_verify, weight: 1.0}
      - {name: think_format, weight: 0.1}
      - name: http_judge            # a class entry: built with args
        weight: 0.5
        args: {url: "http://127.0.0.1:8000/v1", model: judge}

Plain function entries (``exact_match``, ``math_verify``, a user's ``pkg.mod:fn``) take no
``args``; class entries (``http_judge``, a user's ``pkg.mod:MyReward``) are instantiated with
``**args`` and then called like a function. The sum runs inside one guarded call (the ``reward:``
timeout and error policy cover the whole sum), and each term's mean is reported as
``reward/<name>_mean`` next to the total. A term's own counters (math-verify's unparseable/wrong,
the judge's retries) are reported as ``reward/<name>/<counter>``.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardforge.rewards.functions import RewardFn, load_reward_fn

__all__ = ["CompositeReward", "RewardTermConfig", "build_reward", "make_reward"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardTermConfig:
    """One term of ``rewards:``: a registered reward (or ``pkg.mod:attr``), its weight and arguments."""

    name: str
    """A name from `shardforge list` (reward function) or ``package.module:attr``."""
    weight: float = 1.0
    """Multiplies the term's value in the sum (may be negative: a penalty)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of a class entry (``http_judge``: url, model, ...); functions take none."""


def make_reward(name: str, args: dict[str, Any] | None = None) -> RewardFn:
    """The reward callable ``name`` names: a function as it is, a class built with ``**args``."""
    entry = load_reward_fn(name)
    args = dict(args or {})
    if inspect.isclass(entry):
        try:
            built: RewardFn = entry(**args)  # type: ignore[assignment]
            return built
        except TypeError as exc:
            params = [p for p in inspect.signature(entry).parameters if p != "self"]
            raise ValueError(
                f"reward {name!r} could not be built with args {sorted(args)}: {exc}; its arguments are {params} "
                f"(rewards: [{{name: {name}, args: {{...}}}}])"
            ) from exc
    if args:
        raise ValueError(f"reward {name!r} is a plain function and takes no args (got {sorted(args)}); drop args")
    return entry


class CompositeReward:
    """``sum_i weight_i * fn_i(prompt, response, reference)``, with per-term means for the metrics."""

    def __init__(self, terms: tuple[RewardTermConfig, ...]) -> None:
        if not terms:
            raise ValueError("rewards: is empty; list at least one {name: ..., weight: ...} term")
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: each name once, got {names}; merge repeated terms into one weight")
        self.terms = terms
        self.fns: list[Callable[..., Any]] = [make_reward(t.name, t.args) for t in terms]
        self.__name__ = "+".join(f"{t.weight:g}*{t.name}" for t in terms)
        self._lock = threading.Lock()
        self._sums = [0.0] * len(terms)
        self._count = 0

    def __call__(self, prompt: str, response: str, reference: str) -> float:
        values = []
        for fn in self.fns:
            value = fn(prompt, response, reference)
            if inspect.isawaitable(value):
                import asyncio

                value = asyncio.run(_awaited(value))
            values.append(float(value))
        with self._lock:
            self._count += 1
            for i, value in enumerate(values):
                self._sums[i] += value
        return sum(t.weight * v for t, v in zip(self.terms, values, strict=True))

    def pop_stats(self) -> dict[str, float]:
        """Per term: ``<name>_sum`` (divided by ``terms_scored``, the calls whose every term returned, after
        the dp sum: ``reward/<name>_mean``) and the term's own counters as ``<name>/<counter>``; the same keys on every rank, called or not."""
        with self._lock:
            sums, count = self._sums, self._count
            self._sums, self._count = [0.0] * len(self.terms), 0
        out = {f"{_key(t.name)}_sum": s for t, s in zip(self.terms, sums, strict=True)} | {"terms_scored": float(count)}
        for term, fn in zip(self.terms, self.fns, strict=True):
            inner = getattr(fn, "pop_stats", None)
            if callable(inner):
                out |= {f"{_key(term.name)}/{k}": float(v) for k, v in inner().items()}
        return out


async def _awaited(value: Any) -> Any:
    return await value


def _key(name: str) -> str:
    """A metric-safe name: ``pkg.mod:fn`` -> ``fn``."""
    return name.rpartition(":")[2].rpartition(".")[2] or name


def build_reward(reward_fn: str, rewards: tuple[RewardTermConfig, ...] = ()) -> RewardFn:
    """``rewards:`` (a weighted sum) when given, else ``reward_fn`` alone (a name, path or class without args)."""
    if rewards:
        return CompositeReward(rewards)
    return make_reward(reward_fn)
