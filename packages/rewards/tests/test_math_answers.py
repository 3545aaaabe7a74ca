"""Math verification (math-verify) and format rewards: equivalent forms score 1, wrong answers 0, strict
mode needs \\boxed{}, "unparseable" and "wrong" are counted apart, and the verifier works on the
reward runner's worker threads (math-verify's own signal-based timeouts would fail there)."""

from __future__ import annotations

import pytest

pytest.importorskip("math_verify")


@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [
        ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),  # decimal vs fraction
        ("so \\boxed{\\frac{1}{2}}", "50\\%", 1.0),  # percentage
        ("\\boxed{\\sqrt 2}", "\\sqrt{2}", 1.0),  # LaTeX forms
        ("we get 12", "12", 1.0),  # lenient: a plain final number
        ("\\boxed{12.0}", "12", 1.0),
        ("\\boxed{0.333333}", "\\frac{1}{3}", 1.0),  # equal after rounding to float_rounding=6 decimals
        ("\\boxed{0.3333}", "\\frac{1}{3}", 0.0),
        ("\\boxed{12.01}", "12", 0.0),
        ("I think 4", "3", 0.0),
        ("no idea", "3", 0.0),
    ],
)
def test_math_verify_accepts_equivalent_forms_only(response: str, reference: str, expected: float) -> None:
    from shardforge.rewards import load_reward_fn

    assert load_reward_fn("math_verify")("", response, reference) == expected


def test_strict_mode_and_unparseable_vs_wrong_counts_through_the_runner() -> None:
    from shardforge.rewards import load_reward_fn
    from shardforge.rewards.guarded import GuardedReward, RewardConfig

    for name in ("math_verify", "math_verify_strict"):  # the registered verifiers are shared: reset their counts
        load_reward_fn(name).pop_stats()  # type: ignore[attr-defined]
    reward = GuardedReward(load_reward_fn("math_verify_strict"), RewardConfig(max_concurrency=2), name="strict")
    items = [("", "\\boxed{7}", "7"), ("", "7", "7"), ("", "\\boxed{8}", "7"), ("", "hmm", "7")]
    assert reward.score_many(items) == [1.0, 0.0, 0.0, 0.0]  # strict: a bare "7" has no \boxed{}
    stats = reward.pop_stats()
    assert (stats["reward/correct"], stats["reward/wrong"], stats["reward/unparseable"]) == (1.0, 1.0, 2.0)
    assert stats["reward/failures"] == 0.0  # ran on worker threads without math-verify's signal timeouts
    lenient = GuardedReward(load_reward_fn("math_verify"), name="lenient")
    assert lenient.score_many(items) == [1.0, 1.0, 0.0, 0.0]
    assert lenient.pop_stats()["reward/unparseable"] == 1.0


def test_format_rewards() -> None:
    from shardforge.rewards import load_reward_fn

    boxed, think = load_reward_fn("boxed_format"), load_reward_fn("think_format")
    assert boxed("", "x = \\boxed{3}", "") == 1.0 and boxed("", "\\boxed{}", "") == 0.0 and boxed("", "3", "") == 0.0
    assert think("", "<think>2+1</think> 3", "") == 1.0
    assert think("", "<think>2+1</think>", "") == 0.0 and think("", "3 <think>x</think> 3", "") == 0.0
