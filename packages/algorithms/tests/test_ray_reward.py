"""``reward.ray_workers`` (issue 21): the pooled reward's splitting, ordering, counts and errors with in-process
stand-ins for the Ray actors (pickled arguments, as Ray sends them), and the refusals. No Ray needed (the Ray
run, same rewards and losses as in process, is integration_tests/test_ray_launch.py)."""

from __future__ import annotations

import pickle

import pytest

from shardforge.algorithms.config_io import build_config
from shardforge.algorithms.trainers.grpo import GRPOConfig
from shardforge.algorithms.trainers.rl.common import build_reward_fn
from shardforge.rewards.guarded import GuardedReward, RewardConfig, RewardError
from shardforge.rewards.ray_pool import (
    REWARD_ACTORS_ENV,
    RayPooledReward,
    RewardActor,
    merge_stats,
    reward_actor_names,
    reward_actor_names_from_env,
    reward_workers_for_launcher,
    split_evenly,
)


def length_or_fail(prompt: str, response: str, reference: str) -> float:
    if response == "boom":
        raise RuntimeError("boom")
    return float(len(response)) + (0.5 if reference == prompt else 0.0)


class _Method:
    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def remote(self, *args):
        self.calls.append(args)
        sent = pickle.loads(pickle.dumps(args))  # what Ray's serialisation does to the arguments
        return lambda: self.fn(*sent)


class _Handle:
    """A Ray actor handle's shape: ``handle.method.remote(...)`` -> a ref; ``_get(ref)`` runs it."""

    def __init__(self, index, dead=False):
        self.actor, self.calls = RewardActor(index), []
        self.register = _Method(self.actor.register, self.calls)
        self.score = _Method(self._dead if dead else self.actor.score, self.calls)

    @staticmethod
    def _dead(*args):
        raise RuntimeError("The actor died unexpectedly before finishing this task.")


def _pooled(workers, config=None, dead=()):
    handles = [_Handle(i, dead=i in dead) for i in range(workers)]
    names = reward_actor_names(workers)
    pooled = RayPooledReward(length_or_fail, config or RewardConfig(), names, handles=handles, get=lambda ref: ref())
    return pooled, handles


@pytest.mark.parametrize(("items", "workers"), [(10, 3), (3, 3), (2, 4), (0, 2), (7, 1)])
def test_split_evenly_covers_every_item_once_in_order(items, workers):
    bounds = split_evenly(items, workers)
    flat = [i for a, b in bounds for i in range(a, b)]
    assert flat == list(range(items))
    sizes = [b - a for a, b in bounds]
    assert len(bounds) <= workers and all(s > 0 for s in sizes)
    assert not sizes or max(sizes) - min(sizes) <= 1


def test_split_evenly_refuses_no_workers():
    with pytest.raises(ValueError, match="num_workers=0"):
        split_evenly(3, 0)


def test_merge_stats_adds_key_by_key():
    assert merge_stats([{"reward/calls": 2, "reward/x": 1}, {"reward/calls": 3}]) == {"reward/calls": 5, "reward/x": 1}


@pytest.mark.parametrize("workers", [1, 3])
def test_pooled_rewards_and_counts_equal_the_in_process_ones(workers):
    items = [(f"p{i}", "r" * i if i != 4 else "boom", f"p{i}" if i % 2 else "x") for i in range(9)]
    local = GuardedReward(length_or_fail, RewardConfig())
    pooled, handles = _pooled(workers)
    assert pooled.score_many(items) == local.score_many(items)
    assert pooled("p1", "abc", "p1") == local("p1", "abc", "p1") == 3.5
    assert pooled.pop_stats() == local.pop_stats() == {
        "reward/calls": 10.0, "reward/failures": 1.0, "reward/timeouts": 0.0, "reward/nonfinite": 0.0,
    }  # fmt: skip
    assert pooled.pop_stats()["reward/calls"] == 0.0  # popped
    scored = [h.actor.scored for h in handles]
    assert sum(scored) == 10 and all(s > 0 for s in scored)  # every actor got a share
    assert all(h.calls[0][0] == pooled.key for h in handles)  # registered once each, under this rank's key


def test_on_error_raise_inside_an_actor_reaches_the_rank_as_a_reward_error():
    pooled, _ = _pooled(2, RewardConfig(on_error="raise"))
    with pytest.raises(RewardError, match="raised on prompt 'p1', response 'boom'"):
        pooled.score_many([("p0", "ok", ""), ("p1", "boom", "")])


def test_a_dead_actor_is_an_error_naming_it():
    pooled, _ = _pooled(2, dead=(1,))
    with pytest.raises(RewardError, match="reward actor shardforge-reward-1 failed: The actor died"):
        pooled.score_many([("a", "b", "c")] * 4)


def test_refusals_without_ray():
    config = build_config(
        GRPOConfig, {"model": "m", "train_file": "t.jsonl", "output_dir": "o", "reward": {"ray_workers": 2}}
    )
    assert reward_workers_for_launcher(config, "ray") == 2
    for launcher in ("local", "slurm", "external"):
        with pytest.raises(ValueError, match=f"only --launcher ray starts \\(this run's launcher: {launcher}\\)"):
            reward_workers_for_launcher(config, launcher)
    with pytest.raises(ValueError, match=f"{REWARD_ACTORS_ENV} is not set"):
        reward_actor_names_from_env(2, env={})
    with pytest.raises(ValueError, match="started 1 reward actors"):
        reward_actor_names_from_env(2, env={REWARD_ACTORS_ENV: "shardforge-reward-0"})
    with pytest.raises(ValueError, match=f"{REWARD_ACTORS_ENV} is not set"):
        build_reward_fn(config)  # a rank under torchrun: refused, not silently in process
    with pytest.raises(ValueError, match=r"reward\.ray_workers=-1 must be >= 0"):
        RewardConfig(ray_workers=-1)


def test_counts_have_every_key_even_when_nothing_was_scored():
    """The ranks all-reduce the counts key by key: a rank that scored nothing reports the same keys (zeros)."""
    pooled, _ = _pooled(2)
    local = GuardedReward(length_or_fail, RewardConfig())
    assert pooled.pop_stats() == local.pop_stats()
    assert pooled.score_many([]) == [] and pooled.pop_stats().keys() == local.pop_stats().keys()


def test_one_item_calls_rotate_over_the_actors():
    """A workflow scores its rollouts one by one: every actor must get a share, not only the first."""
    pooled, handles = _pooled(2)
    assert [pooled("p", "r" * i, "") for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    assert [h.actor.scored for h in handles] == [2, 2]
