"""Math answer verification on `math-verify` (HF's verifier; + latex2sympy2-extended), and format rewards.

Registered reward functions (``reward_fn: <name>``):

- ``math_verify``: 1.0 when the response's final answer is mathematically equal to the reference
  (fractions, decimals, percentages, LaTeX, sets, intervals; numbers compared after rounding to
  ``float_rounding`` = 6 decimals), else 0.0. Lenient: the last ``\\boxed{}`` if any, else the last
  LaTeX/plain expression in the response.
- ``math_verify_strict``: only a ``\\boxed{}`` answer counts (a response without one is "unparseable").
- ``boxed_format``: 1.0 when the response has a non-empty ``\\boxed{...}``, else 0.0.
- ``think_format``: 1.0 when the response is ``<think>...</think>`` followed by a non-empty answer.

`MathVerifier` keeps separate counts of "unparseable" (no answer could be extracted) and "wrong"
(an answer, not equal); `GuardedReward.pop_stats` reports them as ``reward/unparseable`` and
``reward/wrong`` next to the call/failure counts. math-verify's own timeouts use ``signal.alarm``,
which works only in the main thread; they are off here, and the reward runner's ``timeout_s``
bounds every call instead.

Install with ``pip install shardforge-rewards[math]``.
"""

from __future__ import annotations

import re
import threading
from typing import Any

__all__ = ["MATH_VERIFY", "MATH_VERIFY_STRICT", "MathVerifier", "boxed_format_reward", "think_format_reward"]

_BOXED = re.compile(r"\\boxed\s*\{\s*[^\s}]")
_THINK = re.compile(r"^\s*<think>.*?</think>\s*\S", re.DOTALL)


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as exc:
        raise ImportError(
            "reward_fn math_verify needs the math-verify package: pip install 'shardforge-rewards[math]' "
            "(or pip install math-verify)"
        ) from exc
    return math_verify


class MathVerifier:
    """``fn(prompt, response, reference) -> 1.0 | 0.0`` by math-verify, counting unparseable and wrong answers."""

    def __init__(self, *, strict: bool = False, float_rounding: int = 6) -> None:
        self.strict, self.float_rounding = strict, float_rounding
        self.__name__ = "math_verify_strict" if strict else "math_verify"
        self._lock = threading.Lock()
        self._counts = {"unparseable": 0, "wrong": 0, "correct": 0}

    def _configs(self) -> list[Any]:
        mv = _math_verify()
        latex = mv.LatexExtractionConfig(try_extract_without_anchor=not self.strict, boxed_match_priority=0)
        return [latex] if self.strict else [latex, mv.ExprExtractionConfig()]

    def __call__(self, prompt: str, response: str, reference: str) -> float:
        mv = _math_verify()
        if self.strict and not _BOXED.search(response):
            outcome = "unparseable"
        else:
            wrapped = reference if "$" in reference or "\\boxed" in reference else f"${reference}$"
            gold = mv.parse(wrapped, parsing_timeout=None)
            answer = mv.parse(response, extraction_config=self._configs(), parsing_timeout=None)
            if not answer:
                outcome = "unparseable"
            elif mv.verify(gold, answer, float_rounding=self.float_rounding, timeout_seconds=None):
                outcome = "correct"
            else:
                outcome = "wrong"
        with self._lock:
            self._counts[outcome] += 1
        return 1.0 if outcome == "correct" else 0.0

    def pop_stats(self) -> dict[str, float]:
        """``unparseable`` / ``wrong`` / ``correct`` counts since the last call."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return {k: float(v) for k, v in counts.items()}


MATH_VERIFY = MathVerifier()
"""The registered ``math_verify`` reward (lenient extraction)."""
MATH_VERIFY_STRICT = MathVerifier(strict=True)
"""The registered ``math_verify_strict`` reward (\\boxed{} answers only)."""


def boxed_format_reward(prompt: str, response: str, reference: str) -> float:
    """1.0 when the response contains a non-empty \\boxed{...} answer, else 0.0."""
    return 1.0 if _BOXED.search(response) else 0.0


def think_format_reward(prompt: str, response: str, reference: str) -> float:
    """1.0 when the response is <think>...</think> followed by a non-empty answer, else 0.0."""
    return 1.0 if _THINK.match(response) else 0.0
