"""Reward functions under a timeout, a concurrency limit and an error policy (`GuardedReward`):
concurrent batches, failures/timeouts/non-finite values counted as zeros or raised, async functions,
no hang at interpreter exit, and a GRPO run whose reward raises on some calls goes on and counts them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _flaky(prompt: str, response: str, reference: str) -> float:
    if prompt == "raise":
        raise KeyError("backend down")
    if prompt == "hang":
        time.sleep(5)
    if prompt == "nan":
        return float("nan")
    return float(response == reference)


def test_failures_timeouts_and_nonfinite_values_score_zero_and_are_counted() -> None:
    from shardforge.rewards.guarded import GuardedReward, RewardConfig

    reward = GuardedReward(_flaky, RewardConfig(timeout_s=0.3, max_concurrency=4))
    items = [("ok", "1", "1"), ("raise", "1", "1"), ("hang", "1", "1"), ("nan", "1", "1"), ("ok", "2", "1")]
    started = time.perf_counter()
    assert reward.score_many(items) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert time.perf_counter() - started < 2.0  # the hanging call was abandoned at its timeout
    assert reward.pop_stats() == {"reward/calls": 5.0, "reward/failures": 1.0, "reward/timeouts": 1.0,
                                  "reward/nonfinite": 1.0}  # fmt: skip
    assert reward.pop_stats()["reward/calls"] == 0.0  # reset
    reward.close()


@pytest.mark.parametrize(
    ("prompt", "message"),
    [("raise", r"the reward function raised on prompt 'raise'.*backend down"),
     ("hang", r"timed out \(reward.timeout_s=0.2\) on prompt 'hang'"),
     ("nan", r"returned nan for prompt 'nan'.*finite")],
)  # fmt: skip
def test_on_error_raise_names_the_prompt_and_the_fix(prompt: str, message: str) -> None:
    from shardforge.rewards.guarded import GuardedReward, RewardConfig, RewardError

    reward = GuardedReward(_flaky, RewardConfig(timeout_s=0.2, on_error="raise"))
    with pytest.raises(RewardError, match=message) as info:
        reward(prompt, "1", "1")
    assert "reward.on_error=raise" in str(info.value)


def test_batches_run_concurrently_up_to_the_limit() -> None:
    from shardforge.rewards.guarded import GuardedReward, RewardConfig

    running, peak, lock = [0], [0], threading.Lock()

    def slow(prompt: str, response: str, reference: str) -> float:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        return 1.0

    reward = GuardedReward(slow, RewardConfig(max_concurrency=3, timeout_s=5))
    started = time.perf_counter()
    assert reward.score_many([("p", "r", "x")] * 9) == [1.0] * 9
    elapsed = time.perf_counter() - started
    assert peak[0] == 3, peak  # never more than max_concurrency at once, and all of them used
    assert elapsed < 0.9 * 0.1 * 9  # 3 at a time: ~0.3 s, not ~0.9 s one by one


def test_async_reward_functions_are_awaited() -> None:
    from shardforge.rewards.guarded import GuardedReward

    async def judge(prompt: str, response: str, reference: str) -> float:
        return 0.5 if response else 0.0

    assert GuardedReward(judge).score_many([("p", "yes", "r"), ("p", "", "r")]) == [0.5, 0.0]


def test_a_reward_that_never_returns_does_not_block_interpreter_exit(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(
        textwrap.dedent("""
        import time
        from shardforge.rewards.guarded import GuardedReward, RewardConfig
        reward = GuardedReward(lambda p, r, x: time.sleep(3600), RewardConfig(timeout_s=0.1))
        print(reward("p", "r", "x"))
    """)
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180
    )  # imports torch: slow on a loaded machine
    assert done.returncode == 0 and done.stdout.strip() == "0.0", done.stderr[-1000:]


def test_bad_settings_are_refused() -> None:
    from shardforge.rewards.guarded import RewardConfig

    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrency=0 must be >= 1"):
        RewardConfig(max_concurrency=0)


def test_grpo_goes_on_when_the_reward_fails_and_counts_the_failures(tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    (tmp_path / "flaky_rewards.py").write_text(
        textwrap.dedent("""
        CALLS = [0]
        def every_third_fails(prompt, response, reference):
            CALLS[0] += 1
            if CALLS[0] % 3 == 0:
                raise ConnectionError("judge unreachable")
            return 1.0 if response.strip() == reference.strip() else 0.0
    """)
    )
    sys.path.insert(0, str(tmp_path))
    try:
        assets = tiny_assets(tmp_path / "a", seed=2, tokenizer_dir="model")
        config = build_config(GRPOConfig, {
            "model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(tmp_path / "out"),
            "layout": "d1", "steps": 2, "prompts_per_step": 2, "group_size": 3, "max_new_tokens": 3,
            "progress": False, "export_hf_at_end": False, "reward_fn": "flaky_rewards:every_third_fails",
        })  # fmt: skip
        run_grpo(config)
    finally:
        sys.path.remove(str(tmp_path))
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train: list[dict[str, Any]] = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert sum(r["reward/calls"] for r in train) == 12 and sum(r["reward/failures"] for r in train) == 4


def test_reward_shaping_is_reachable_from_the_rl_config_and_applies_after_sampling(tmp_path: Path) -> None:
    from types import SimpleNamespace

    import torch

    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig
    from shardforge.algorithms.trainers.rl.sampling import make_sample_fn
    from shardforge.engine.objectives import overlong_penalty

    base = {"model": "m", "train_file": "t", "output_dir": str(tmp_path), "group_size": 2, "prompts_per_step": 2}
    lengths = [1, 3, 5, 8]  # generated tokens of each trajectory (prompt tokens have mask 0)
    trajectories = [SimpleNamespace(loss_mask=[0, 0] + [1] * n) for n in lengths]
    raw = torch.tensor([1.0, 1.0, 0.0, 1.0])

    def round_fn(index: int, round_: int) -> tuple[list[Any], torch.Tensor]:
        return trajectories, raw.clone()

    one_rank: Any = SimpleNamespace(dp_rank=0, dp_size=1)

    plain, _ = make_sample_fn(build_config(GRPOConfig, base), round_fn, one_rank)
    assert plain(0)[1].tolist() == raw.tolist()
    shaping = {"overlong_max_length": 6, "overlong_cache_length": 4, "scale": 2.0}
    shaped_fn, _ = make_sample_fn(build_config(GRPOConfig, base | {"reward_shaping": shaping}), round_fn, one_rank)
    penalty = overlong_penalty(torch.tensor(lengths), max_length=6, cache_length=4)  # DAPO eq. 13
    assert penalty.tolist() == [0.0, -0.25, -0.75, -1.0]  # free up to 2 tokens, then -1/4 per token, -1 above 6
    torch.testing.assert_close(shaped_fn(0)[1], 2.0 * (raw + penalty))
