"""What streaming does with a LATE group (``late_groups`` / ``rollout.streaming_late_groups``, `streaming_late`): one
still generating when the last batch its staleness bound allows is assembled.

A fake engine makes chosen prompt positions slow every time they are generated (as a prompt with a long answer is),
far slower than a training step, so they can only be trained if the trainer waits for them. Each policy keeps the
bound and trains every position exactly once; they differ in how often the slow prompt is generated and when it is
trained. `PromptOrder` (the order prompts start in) is checked by hand.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardforge.algorithms.trainers.rl.streaming import StreamingRollouts
from shardforge.algorithms.trainers.rl.streaming_late import PromptOrder
from shardforge.rollout.episodes.trajectory import Trajectory

GROUP, SLOW_S, TRAIN_S = 2, 0.4, 0.02


def _stream(late_groups: str, slow: set[int], b: int, n: int) -> tuple[StreamingRollouts, dict[int, int], list[int]]:
    """The source; each position's generate count; the positions in the order their generation started."""
    attempts: dict[int, int] = {}
    starts: list[int] = []
    lock = threading.Lock()

    def group(position: int) -> tuple[list[Trajectory], torch.Tensor]:
        with lock:
            attempts[position] = attempts.get(position, 0) + 1
            starts.append(position)
        if position in slow:
            time.sleep(SLOW_S)
        trajs = [
            Trajectory(group=position, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0] * 2, versions=[0] * 2)
            for _ in range(GROUP)
        ]
        return trajs, torch.zeros(GROUP)

    src = StreamingRollouts(
        group_fn=group, load_weights=lambda v: None, publish_fn=lambda v: None, prompts_per_step=b, max_staleness=1,
        num_batches=n, workers=4, late_groups=late_groups,
    )  # fmt: skip
    return src, attempts, starts


def _train(src: StreamingRollouts, n: int) -> dict[int, int]:
    """Run ``n`` steps; return the batch each position was trained in (and check the bound on the way)."""
    trained: dict[int, int] = {}
    try:
        for k in range(n):
            batch = src.batch(k)
            for t in batch.rollouts[::GROUP]:
                assert t.group not in trained, f"position {t.group} trained twice"
                trained[t.group] = k
            assert all(k - v <= 1 for v in src.infos[-1].start_versions), (k, src.infos[-1].start_versions)
            assert len(batch.rollouts) == GROUP * src.prompts_per_step, "whole batches of whole groups"
            time.sleep(TRAIN_S)
            src.publish(k + 1)
    finally:
        src.close()
    return trained


def test_wait_trains_a_late_group_from_its_only_attempt() -> None:
    b, n = 2, 6
    src, attempts, _ = _stream("wait", {1}, b, n)
    trained = _train(src, n)
    assert sorted(trained) == list(range(n * b))
    assert attempts[1] == 1, "nothing generated is thrown away"
    assert trained[1] <= 1, "the last batch the bound allows for a group started under policy 0 waited for it"
    assert src.infos[trained[1]].start_versions[src.infos[trained[1]].positions.index(1)] == 0


def test_defer_starts_a_late_prompt_again_after_the_fresh_ones_and_waits_for_it() -> None:
    b, n = 2, 6
    src, attempts, starts = _stream("defer", {1}, b, n)
    trained = _train(src, n)
    assert sorted(trained) == list(range(n * b))
    assert attempts[1] == 2, "released once, and the second attempt was waited for"
    retry = [i for i, p in enumerate(starts) if p == 1][1]
    assert retry > starts.index(n * b - 1), "started again only once every fresh position had started"


def test_defer_starts_a_batchs_worth_of_deferred_prompts_together_before_the_run_ends() -> None:
    b, n = 2, 12
    src, attempts, starts = _stream("defer", {1, 2}, b, n)
    trained = _train(src, n)
    assert sorted(trained) == list(range(n * b))
    assert attempts[1] == attempts[2] == 2
    retries = [i for i, p in enumerate(starts) if p in (1, 2)][2:]
    assert max(retries) < starts.index(n * b - 1), "a batch's worth deferred starts again before the run's end"
    assert abs(retries[0] - retries[1]) == 1, "together"


def test_regenerate_starts_a_late_prompt_again_at_once() -> None:
    b, n = 2, 6
    src, attempts, _ = _stream("regenerate", {1}, b, n)
    trained = _train(src, n)
    assert sorted(trained) == list(range(n * b))
    assert attempts[1] >= 2, "released and regenerated"


def test_prompt_order_by_hand() -> None:
    order = PromptOrder(late_groups="defer", restored=[4, 5], next_position=6, end=10, flush_at=2)
    assert [order.take() for _ in range(3)] == [4, 5, 6]  # the checkpoint's first, then fresh
    order.release(5)
    assert order.take() == 7 and order.pending() == [5]  # one deferred: below flush_at, fresh go first
    order.release(4)
    assert [order.take() for _ in range(3)] == [5, 4, 8]  # a batch's worth deferred: all of them start, together
    assert order.waits_for(5) and order.waits_for(4) and not order.waits_for(8)
    order.release(8)
    assert [order.take() for _ in range(2)] == [9, 8]  # fresh ones run out (end=10): the deferred one goes next
    assert order.take() == 10  # beyond the run's positions (dynamic sampling's replacements)
    now = PromptOrder(late_groups="regenerate", restored=[], next_position=0, end=4, flush_at=2)
    assert [now.take(), now.take()] == [0, 1]
    now.release(0)
    assert now.take() == 0 and not now.waits_for(0)
    assert PromptOrder(late_groups="wait", restored=[], next_position=0, end=4, flush_at=2).waits_for(3)


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"late_groups='drop' is not a late-group policy; valid: defer, wait, regen"):
        PromptOrder(late_groups="drop", restored=[], next_position=0, end=4, flush_at=2)


def test_a_checkpoint_keeps_the_deferred_prompts() -> None:
    b, n = 2, 8
    src, _, starts = _stream("defer", {1}, b, n)
    try:
        for k in range(3):
            src.batch(k)
            time.sleep(TRAIN_S)
            src.publish(k + 1)
        state = src.checkpoint_state()
    finally:
        src.close()
    assert starts.count(1) == 1 and 1 not in [t for k in range(3) for t in src.infos[k].positions]
    assert 1 in state["regenerate"], state  # deferred, not started again yet: a resumed run regenerates it first


def test_the_config_names_the_policy_and_refuses_an_unknown_one() -> None:
    from shardforge.rollout.config import RolloutConfig

    assert RolloutConfig().streaming_late_groups == "defer"
    assert RolloutConfig(streaming_late_groups="wait").streaming_late_groups == "wait"
    with pytest.raises(ValueError, match=r"rollout.streaming_late_groups='drop' is not one of \('defer', 'wait'"):
        RolloutConfig(streaming_late_groups="drop")  # type: ignore[arg-type]
