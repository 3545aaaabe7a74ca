"""Verifiable reward functions: the built-in exact-match math reward and user functions by path.

A reward function is ``fn(prompt: str, response: str, reference: str) -> float``. It is
called once per rollout; an exception or a non-finite value stops the step with an error
that names the prompt and response (a silent NaN would poison the advantages).

Built-in functions are registered by name in `REWARD_FUNCTIONS`; register your own with
``@REWARD_FUNCTIONS.register("name")`` (in a module your run imports) or name it in the config
as ``reward_fn: package.module:function``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from shardforge.core.registry import Registry

__all__ = ["REWARD_FUNCTIONS", "RewardFn", "exact_match_reward", "load_reward_fn"]

RewardFn = Callable[[str, str, str], float]

REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@REWARD_FUNCTIONS.register("exact_match")
def exact_match_reward(prompt: str, response: str, reference: str) -> float:
    """1.0 when the response's answer equals the reference, else 0.0.

    The answer is the whole stripped response; if that is not an exact match, numeric answers
    are compared as numbers (so "42" and "42.0" agree) — but only when the response is a
    single number, so "4 or 42" never scores.
    """
    answer, expected = response.strip(), reference.strip()
    if answer == expected:
        return 1.0
    if _NUMBER.fullmatch(answer) and _NUMBER.fullmatch(expected):
        return 1.0 if float(answer) == float(expected) else 0.0
    return 0.0


REWARD_FUNCTIONS.add("exact-match", exact_match_reward, doc="alias of exact_match")
_MATH = "shardforge.rewards.math_answers"
REWARD_FUNCTIONS.register_lazy(
    "math_verify",
    f"{_MATH}:MATH_VERIFY",
    "math-verify equivalence of the final answer (last \\boxed{} first); [math] extra",
)
REWARD_FUNCTIONS.register_lazy(
    "math_verify_strict",
    f"{_MATH}:MATH_VERIFY_STRICT",
    "math-verify, only a \\boxed{} answer counts (else unparseable)",
)
REWARD_FUNCTIONS.register_lazy(
    "boxed_format", f"{_MATH}:boxed_format_reward", "1.0 when the response has a \\boxed{} answer"
)
REWARD_FUNCTIONS.register_lazy(
    "http_judge",
    "shardforge.rewards.http_judge:HTTPJudgeReward",
    "remote judge over HTTP (OpenAI chat or JSON), retries + backoff; args: url, model, template, ...",
)


@REWARD_FUNCTIONS.register("zero")
def zero_reward(prompt: str, response: str, reference: str) -> float:
    """0.0 for every response (when a reward model or another term supplies the whole reward)."""
    return 0.0


REWARD_FUNCTIONS.register_lazy(
    "think_format", f"{_MATH}:think_format_reward", "1.0 for <think>...</think> followed by an answer"
)


def load_reward_fn(spec: str | RewardFn) -> RewardFn:
    """A name in `REWARD_FUNCTIONS`, ``"package.module:function"`` (or ``package.module.function``) or a callable."""
    if callable(spec):
        return spec
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS.get(spec)
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"unknown reward function {spec!r}; registered: {REWARD_FUNCTIONS.names()} "
            "(or a user's, as 'package.module:function')"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name!r} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]
