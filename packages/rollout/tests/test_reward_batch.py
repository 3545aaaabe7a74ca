"""A step's rewards are scored as one batch (issue 21): every episode's ``await score_in_batch(...)`` waits in the
`RequestQueue` and the round's items go to the reward source at once, so `GuardedReward` scores them on its threads
and ``reward.ray_workers`` spreads them over the actors concurrently. Checked with a scripted engine and in-process
stand-ins for the Ray actors (threads): one call per round, the sequential path's rewards and call order, chunks
in flight together, failures and timeouts counted (and failing) per item."""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from shardforge.rewards.batch import score_outcomes
from shardforge.rewards.guarded import GuardedReward, RewardConfig
from shardforge.rewards.ray_pool import RayPooledReward, RewardActor, reward_actor_names
from shardforge.rollout import Rollout, SamplingParams
from shardforge.rollout.workflows import MultiTurnConfig, PromptRow, WorkflowConfig, build_workflow, run_episodes
from shardforge.rollout.workflows.base import new_trajectory, score


class CharTokenizer:
    eos_token = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


class SeedEngine:
    """Answers each request with ``s<its seed>`` (episode ``j`` of row ``g``: seed ``10 g + j``), records calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def generate(self, prompts: Any, params: SamplingParams) -> list[Rollout]:
        self.calls.append(len(prompts))
        outs = []
        for i, prompt in enumerate(prompts):
            text = f"s{params.seeds[i]}"
            ids = [ord(c) for c in text]
            outs.append(
                Rollout(
                    prompt_index=i, prompt_ids=list(prompt), response_ids=ids, logprobs=[-0.1] * len(ids),
                    finished=True, version=0, text=text,
                )
            )  # fmt: skip
        return outs

    def update_weights(self, version: int | None = None) -> int:
        return 0


def _rows(count: int) -> list[PromptRow]:
    return [PromptRow(index=g, prompt=f"p{g}", reference=f"s{10 * g}", prompt_ids=[1, 2, g], seed=10 * g)
            for g in range(count)]  # fmt: skip


def length_reward(prompt: str, response: str, reference: str) -> float:
    """Depends on the whole item; reference match earns 0.5 more."""
    return float(len(response) + len(prompt)) + (0.5 if response == reference else 0.0)


class Recording:
    """A plain reward function that records its calls (no ``score_many``)."""

    def __init__(self, fn: Any = length_reward) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, prompt: str, response: str, reference: str) -> float:
        self.calls.append((prompt, response, reference))
        return float(self.fn(prompt, response, reference))


class BatchRecording(Recording):
    def __init__(self, fn: Any = length_reward) -> None:
        super().__init__(fn)
        self.batches: list[int] = []

    def score_many(self, items: list[tuple[str, str, str]]) -> list[float]:
        self.batches.append(len(items))
        return [self(*item) for item in items]


class SequentialRLVR:
    """The path before batching: each episode calls the reward function itself (`score`), one at a time."""

    def __init__(self, reward_fn: Any) -> None:
        self.reward_fn = reward_fn

    async def run_episode(self, engine: Any, row: PromptRow) -> list[Any]:
        trajectory = new_trajectory(row, row.prompt_ids)
        out = await engine.generate(trajectory.token_ids)
        trajectory.append(out.response_ids, logprobs=out.logprobs, version=out.versions)
        trajectory.reward = score(self.reward_fn, row, out.text)
        trajectory.text = out.text
        return [trajectory]


PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)


def _run(reward_fn: Any, name: str = "rlvr", rows: int = 3, drop: bool = False, **options: Any) -> Any:
    workflow = build_workflow(WorkflowConfig(name=name, **options), CharTokenizer(), reward_fn)
    engine = SeedEngine()
    return run_episodes(workflow, engine, _rows(rows), 2, PARAMS, drop_failed=drop), engine


def test_a_step_scores_its_rewards_in_one_batched_call():
    fn = BatchRecording()
    trajectories, engine = _run(fn)
    assert engine.calls == [6] and trajectories.generate_calls == 1
    assert fn.batches == [6] and trajectories.reward_calls == 1, "one reward call for the step, not one per episode"
    # multi-turn: one reward call per round, between the generate rounds (wrong answers: every episode goes on)
    fn = BatchRecording(lambda prompt, response, reference: 0.0)
    trajectories, engine = _run(fn, "multi_turn", max_turns=3, multi_turn=MultiTurnConfig(feedback="no"))
    assert engine.calls == [6, 6, 6] and fn.batches == [6, 6, 6] and trajectories.reward_calls == 3


def test_the_batch_gives_the_sequential_paths_rewards_in_its_order():
    sequential = Recording()
    want = run_episodes(SequentialRLVR(sequential), SeedEngine(), _rows(3), 2, PARAMS, drop_failed=False)
    assert [t.text for t in want] == ["s0", "s1", "s10", "s11", "s20", "s21"]
    plain = Recording()
    got, _ = _run(plain)
    # a plain function gets the same calls, item by item, in episode order (the sequential path's order was the
    # event loop's: the episode that completed the generate round first, then the others)
    assert plain.calls == [(f"p{t.group}", t.text, f"s{10 * t.group}") for t in want]
    assert sorted(plain.calls) == sorted(sequential.calls)
    assert [t.reward for t in got] == [t.reward for t in want] == [length_reward(*c) for c in plain.calls]
    assert [t.token_ids for t in got] == [t.token_ids for t in want]
    for source in (GuardedReward(length_reward, RewardConfig(max_concurrency=4)), _pooled(2)[0], _pooled(4)[0]):
        assert [t.reward for t in _run(source)[0]] == [t.reward for t in want], source


class _ThreadMethod:
    """``handle.method.remote(...)`` runs on the handle's own thread (an actor runs concurrently with the others);
    the score arguments travel pickled, as Ray sends them."""

    def __init__(self, fn: Any, pool: ThreadPoolExecutor, pickled: bool) -> None:
        self.fn, self.pool, self.pickled = fn, pool, pickled

    def remote(self, *args: Any) -> Any:
        sent = pickle.loads(pickle.dumps(args)) if self.pickled else args
        return self.pool.submit(self.fn, *sent)


class _ThreadHandle:
    def __init__(self, index: int) -> None:
        self.actor, pool = RewardActor(index), ThreadPoolExecutor(1)
        self.register = _ThreadMethod(self.actor.register, pool, pickled=False)
        self.score = _ThreadMethod(self.actor.score, pool, pickled=True)


def _pooled(workers: int, fn: Any = length_reward, config: RewardConfig | None = None) -> Any:
    handles = [_ThreadHandle(i) for i in range(workers)]
    pooled = RayPooledReward(
        fn, config or RewardConfig(), reward_actor_names(workers), handles=handles, get=lambda f: f.result(timeout=30)
    )
    return pooled, handles


INTERVALS: list[tuple[float, float]] = []
BARRIER = threading.Barrier(2, timeout=3.0)


def meeting_reward(prompt: str, response: str, reference: str) -> float:
    """Passes only when another actor's chunk is scoring at the same time (each actor scores one item at a time)."""
    start = time.monotonic()
    BARRIER.wait()
    time.sleep(0.02)
    INTERVALS.append((start, time.monotonic()))
    return length_reward(prompt, response, reference)


def test_the_pool_scores_a_steps_chunks_concurrently():
    INTERVALS.clear()
    BARRIER.reset()
    # max_concurrency=1: an actor scores its chunk item by item, so the barrier (2 parties) passes only when both
    # actors' chunks are in flight together
    pooled, handles = _pooled(2, meeting_reward, RewardConfig(max_concurrency=1, timeout_s=10.0))
    trajectories, _ = _run(pooled, rows=2)
    stats = pooled.pop_stats()
    assert stats["reward/calls"] == 4.0 and stats["reward/failures"] == 0.0, stats
    assert [t.reward for t in trajectories] == [length_reward(f"p{g}", f"s{10 * g + j}", f"s{10 * g}")
                                                for g in range(2) for j in range(2)]  # fmt: skip
    assert [h.actor.scored for h in handles] == [2, 2]
    first, second = sorted(INTERVALS)[:2]
    assert second[0] < first[1], f"the two chunks did not overlap: {INTERVALS}"


def flaky_reward(prompt: str, response: str, reference: str) -> float:
    if response == "s1":
        raise KeyError("verifier bug")
    if response == "s11":
        time.sleep(1.0)
    if response == "s20":
        return float("nan")
    return length_reward(prompt, response, reference)


@pytest.mark.parametrize("pool", [0, 2])
def test_failures_and_timeouts_are_counted_and_fail_per_item(pool):
    def source(on_error: str) -> Any:
        config = RewardConfig(timeout_s=0.3, on_error=on_error)  # type: ignore[arg-type]
        return _pooled(pool, flaky_reward, config)[0] if pool else GuardedReward(flaky_reward, config)

    zero = source("zero")
    trajectories, _ = _run(zero)
    bad = {"s1", "s11", "s20"}
    assert [t.reward == 0.0 for t in trajectories] == [t.text in bad for t in trajectories]
    assert [t.reward for t in trajectories if t.text not in bad] == [
        length_reward("p0", "s0", "s0"), length_reward("p1", "s10", "s10"), length_reward("p2", "s21", "s20"),
    ]  # fmt: skip
    assert zero.pop_stats() == {
        "reward/calls": 6.0, "reward/failures": 1.0, "reward/timeouts": 1.0, "reward/nonfinite": 1.0,
    }  # fmt: skip
    # on_error=raise: each bad item fails its own episode (its group is dropped), the others keep their rewards
    raising = source("raise")
    kept, _ = _run(raising, rows=4, drop=True)
    assert kept.num_failed == 3 and kept.num_dropped == 6 and [t.text for t in kept] == ["s30", "s31"]
    assert kept[0].reward == length_reward("p3", "s30", "s30")
    assert "RewardError" in kept.first_error and "'p0', response 's1'" in kept.first_error
    assert raising.pop_stats()["reward/calls"] == 8.0


def test_score_outcomes_of_plain_batch_and_failing_sources():
    items = [("p", "ok", "r"), ("p", "boom", "r")]

    def plain(prompt: str, response: str, reference: str) -> float:
        if response == "boom":
            raise ValueError("boom")
        return 1.0

    out = score_outcomes(plain, items)
    assert out[0] == 1.0 and isinstance(out[1], ValueError)

    class Batch:
        def score_many(self, batch: list[Any]) -> list[float]:
            raise RuntimeError("the judge is down")

        def __call__(self, *item: str) -> float:
            raise AssertionError("a batch scorer is called with the batch")

    out = score_outcomes(Batch(), items)
    assert all(isinstance(o, RuntimeError) and "judge is down" in str(o) for o in out)
    assert score_outcomes(plain, []) == []
