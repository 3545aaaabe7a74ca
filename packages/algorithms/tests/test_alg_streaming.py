"""StreamingRollouts (issue 41): staleness bound, complete groups, s=0 == synchronous, lossless resume.

A fake group function stands in for the rollout engine: its output depends only on the prompt position and
the loaded weight version, so what each batch contains is checkable exactly.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from shardforge.algorithms.trainers.rl.streaming import StreamingRollouts
from shardforge.rollout.episodes.trajectory import Trajectory

GROUP = 2


class FakeEngine:
    def __init__(self, delays: bool, seed: int = 0) -> None:
        self.version = -1
        self.rng = random.Random(seed)
        self.delays = delays
        self.outstanding: list[tuple[int, int, int]] = []
        self.source: StreamingRollouts | None = None
        self.lock = threading.Lock()

    def load(self, version: int) -> None:
        self.version = version

    def group(self, position: int) -> tuple[list[Trajectory], torch.Tensor]:
        if self.source is not None:
            src = self.source
            # (prompts started so far, newest published step, groups in flight or finished-unused)
            self.outstanding.append((src._submitted, src._version, len(src._groups)))
        if self.delays:
            time.sleep(self.rng.choice([0.0, 0.0, 0.002, 0.01]))
        trajs = [
            Trajectory(
                group=position,
                token_ids=[1, 2, 3],
                loss_mask=[0, 1, 1],
                logprobs=[0.0] * 3,
                versions=[self.version] * 3,
            )
            for _ in range(GROUP)
        ]
        return trajs, torch.full((GROUP,), position + 0.001 * self.version)


def _run(src: StreamingRollouts, engine: FakeEngine, first: int, last: int, train_s: float = 0.0):
    batches = []
    for k in range(first, last):
        b = src.batch(k)
        batches.append(b)
        if train_s:
            time.sleep(train_s)
        src.publish(k + 1)
    return batches


def _source(
    engine: FakeEngine, s: int, b: int, n: int, start: int = 0, restored=None, workers: int = 1
) -> StreamingRollouts:
    src = StreamingRollouts(
        group_fn=engine.group,
        load_weights=engine.load,
        publish_fn=lambda step: None,
        prompts_per_step=b,
        max_staleness=s,
        num_batches=n,
        start=start,
        restored=restored,
        workers=workers,
    )
    engine.source = src
    return src


@pytest.mark.parametrize(("s", "workers"), [(1, 1), (2, 3)])
def test_streaming_staleness_bound_and_complete_groups(s: int, workers: int) -> None:
    b, n = 3, 8
    engine = FakeEngine(delays=True, seed=s)
    src = _source(engine, s, b, n, workers=workers)
    try:
        batches = _run(src, engine, 0, n, train_s=0.03)  # slower than generation: admission is what limits
    finally:
        src.close()
    seen: list[int] = []
    for k, (batch, info) in enumerate(zip(batches, src.infos, strict=True)):
        assert len(info.positions) == b and len(batch.rollouts) == b * GROUP
        assert all(k - v <= s for v in info.start_versions), (k, info.start_versions)
        assert batch.stats["stream/staleness_max"] <= s
        # every group complete and from one prompt, loaded with a version the bound allows
        for pos in info.positions:
            members = [t for t in batch.rollouts if t.group == pos]
            assert len(members) == GROUP
            assert all(k - t.versions[0] <= s for t in members)
        assert sorted(info.finish_order) == info.positions
        seen += info.positions
    assert len(seen) == len(set(seen)) == n * b
    # AReaL's admission rule: prompts started <= (s + newest published step + 1) * b, reached (the generator runs
    # ahead as far as the bound allows), so at most (s + 1) * b are in flight or finished-unused
    slack = [started - (s + version + 1) * b for started, version, _ in engine.outstanding]
    assert max(slack) == 0, slack
    assert max(held for _, _, held in engine.outstanding) <= (s + 1) * b


def test_streaming_max_staleness_zero_is_synchronous() -> None:
    b, n = 2, 4
    engine = FakeEngine(delays=True)
    src = _source(engine, 0, b, n)
    try:
        batches = _run(src, engine, 0, n)
    finally:
        src.close()
    for k, batch in enumerate(batches):
        # the synchronous trainer: batch k = prompts k*b .. (k+1)*b - 1, generated with the weights of step k
        expected = torch.tensor([p + 0.001 * k for p in range(k * b, (k + 1) * b) for _ in range(GROUP)])
        torch.testing.assert_close(batch.rewards, expected, rtol=0, atol=1e-6)
        assert batch.policy_step == k and batch.stats["stream/staleness_max"] == 0.0
        assert batch.stats["stream/regenerated"] == 0.0  # admission alone kept it on-policy


def test_streaming_checkpoint_resume_neither_drops_nor_repeats() -> None:
    b, n, cut = 3, 6, 2
    engine = FakeEngine(delays=True, seed=3)
    src = _source(engine, 1, b, n)
    first = _run(src, engine, 0, cut, train_s=0.01)
    deadline = time.monotonic() + 5.0
    while len(src._groups) < 2 and time.monotonic() < deadline:  # the generator has run ahead (timing-proof)
        time.sleep(0.001)
    state = src.checkpoint_state()
    src.close()  # the killed run: its in-flight and finished-unused groups are lost
    assert state["regenerate"], "something was in flight or finished-unused at the checkpoint"
    engine2 = FakeEngine(delays=True, seed=4)
    src2 = _source(engine2, 1, b, n, start=cut, restored=state)
    try:
        second = _run(src2, engine2, cut, n)
    finally:
        src2.close()
    positions = [t.group for batch in first + second for t in batch.rollouts[::GROUP]]
    assert sorted(positions) == list(range(n * b))  # every prompt exactly once
    assert all(v >= cut for info in src2.infos for v in info.start_versions)


def test_streaming_generator_error_reaches_trainer() -> None:
    def boom(position: int):
        raise ValueError("engine down")

    src = StreamingRollouts(
        group_fn=boom,
        load_weights=lambda v: None,
        publish_fn=lambda v: None,
        prompts_per_step=1,
        max_staleness=1,
        num_batches=2,
    )
    with pytest.raises(RuntimeError, match="streaming generator failed") as info:
        src.batch(0)
    assert isinstance(info.value.__cause__, ValueError)
    src.close()


def test_streaming_several_groups_per_call_keep_the_bound_and_the_schedule() -> None:
    """``groups_fn``: a worker admits as many prompts as the bound allows (up to ``groups_per_call``) and generates
    them in one call (an engine without continuous batching); they finish together."""
    b, n, s = 3, 6, 1
    engine = FakeEngine(delays=True, seed=5)
    calls: list[tuple[list[int], int, int]] = []  # (positions, prompts started, newest published step)
    ready = threading.Event()  # the generator starts in the constructor, before `src` is bound

    def groups(positions: list[int]) -> list[tuple[list[Trajectory], torch.Tensor]]:
        assert ready.wait(30)
        calls.append((positions, src._submitted, src._version))
        return [engine.group(p) for p in positions]

    src = StreamingRollouts(
        group_fn=engine.group, load_weights=engine.load, publish_fn=lambda step: None, prompts_per_step=b,
        max_staleness=s, num_batches=n, groups_fn=groups, groups_per_call=b,
    )  # fmt: skip
    ready.set()
    try:
        batches = _run(src, engine, 0, n, train_s=0.02)
    finally:
        src.close()
    assert all(1 <= len(positions) <= b for positions, _, _ in calls)
    assert all(started <= (s + version + 1) * b for _, started, version in calls), calls
    assert calls[0][0] == [0, 1, 2], "the first call takes a whole batch's prompts"
    positions = [t.group for batch in batches for t in batch.rollouts[::GROUP]]
    assert sorted(positions) == list(range(n * b))
    for k, info in enumerate(src.infos):
        assert all(k - v <= s for v in info.start_versions), (k, info.start_versions)


class _ConcurrentEngine:
    """A rollout engine that serves concurrent generate calls (a server): records each call's weight version at its
    start and end, and how many calls overlap."""

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[tuple[list[int], int, int]] = []  # (positions, version at start, version at end)
        self.lock = threading.Lock()
        self.active = self.overlapped = 0

    def update_weights(self, version: int) -> None:
        with self.lock:
            assert self.active == 0, "weights switched under a call in flight"
            self.version = version

    def groups(self, positions: list[int]) -> list[tuple[list[Trajectory], torch.Tensor]]:
        with self.lock:
            self.active += 1
            self.overlapped = max(self.overlapped, self.active)
            start = self.version
        time.sleep(0.02 + 0.01 * (positions[0] % 3))
        out = []
        for p in positions:
            trajs = [
                Trajectory(group=p, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0] * 2, versions=[start] * 2)
                for _ in range(GROUP)
            ]
            out.append((trajs, torch.full((GROUP,), float(p))))
        with self.lock:
            self.active -= 1
            self.calls.append((positions, start, self.version))
        return out


def test_streaming_source_workers_overlap_calls_and_switch_weights_between_them(tmp_path) -> None:
    """``rollout.streaming_workers=2``: two generate calls in flight at once, each of half a rank's batch share, every
    call under one weight version (a switch waits for none in flight), every prompt position trained once, the bound
    kept; an evaluation runs with no call in flight."""
    from shardforge.algorithms.trainers.rl.streaming_source import StreamingSource

    engine = _ConcurrentEngine()
    published: list[int] = []

    def publish(version: int | None) -> int:
        published.append(len(published) + 1 if version is None else version)
        return published[-1]

    b, n, s = 4, 6, 1
    src = StreamingSource(
        rollout=engine, groups_fn=engine.groups, publish_fn=publish, prompts_per_step=b, max_staleness=s,  # type: ignore[arg-type]
        num_batches=n, start=0, dp_rank=0, dp_size=1, workers=2, record_dir=tmp_path,
    )  # fmt: skip
    try:
        batches = []
        for k in range(n):
            batches.append(src.batch(k))
            if k == 2:  # evaluation between calls: nothing in flight, the newest weights
                assert src.evaluate(lambda e: (e.active, e.version)) == (0, published[-1])
            time.sleep(0.03)  # "training"
            src.publish(k + 1)
    finally:
        src.close()
    assert src.max_active == 2 and engine.overlapped == 2, "two calls in flight at once"
    assert all(len(positions) <= b // 2 for positions, _, _ in engine.calls), engine.calls
    assert all(start == end for _, start, end in engine.calls), "one weight version per call"
    positions = sorted(t.group for batch in batches for t in batch.rollouts[::GROUP])
    assert positions == list(range(n * b)), "every prompt position once"
    assert all(batch.index - batch.policy_step <= s for batch in batches)


def test_streaming_dynamic_sampling_drops_groups_as_they_finish_and_waits_for_kept_ones() -> None:
    """``keep_fn``: dropped groups free their place at once, every batch is ``prompts_per_step`` kept groups, every
    position is trained or dropped exactly once, and the staleness bound holds."""
    b, n, s = 3, 5, 1
    engine = FakeEngine(delays=True, seed=3)
    src = StreamingRollouts(
        group_fn=engine.group, load_weights=engine.load, publish_fn=lambda step: None, prompts_per_step=b,
        max_staleness=s, num_batches=n, keep_fn=lambda trajs: "all_fail" if trajs[0].group % 3 == 0 else None,
        max_rounds=3,
    )  # fmt: skip
    try:
        batches = _run(src, engine, 0, n, train_s=0.01)
    finally:
        src.close()
    trained = [t.group for batch in batches for t in batch.rollouts[::GROUP]]
    filtered = [p for info in src.infos for p in info.filtered]
    assert all(len(batch.rollouts) == b * GROUP for batch in batches), "whole batches of kept groups"
    assert all(p % 3 for p in trained) and all(p % 3 == 0 for p in filtered)
    assert sorted(trained + filtered) == list(range(len(trained) + len(filtered))), "each position once, none lost"
    assert len(trained) == n * b and batches[-1].stats["stream/filtered_all_fail"] >= n * b // 2 - 1
    assert all(batch.stats["stream/cap_hit"] == 0.0 for batch in batches)
    for k, info in enumerate(src.infos):
        assert all(k - v <= s for v in info.start_versions), (k, info.start_versions)


def test_streaming_dynamic_sampling_cap_trains_on_what_it_has() -> None:
    """``max_rounds`` caps the prompts started; a batch the cap leaves short trains on its kept groups, and one with
    none on the last dropped group (a placeholder), so the run never waits forever."""
    b, n = 4, 3
    engine = FakeEngine(delays=False)
    src = StreamingRollouts(
        group_fn=engine.group, load_weights=engine.load, publish_fn=lambda step: None, prompts_per_step=b,
        max_staleness=0, num_batches=n, keep_fn=lambda trajs: None if trajs[0].group in (1, 2) else "all_pass",
        max_rounds=2,
    )  # fmt: skip
    try:
        batches = _run(src, engine, 0, n)
    finally:
        src.close()
    sizes = [len(batch.rollouts) // GROUP for batch in batches]
    assert sizes == [2, 1, 1], sizes  # batch 0: positions 1, 2 kept of 0..7; then the placeholders
    assert [batch.stats["stream/cap_hit"] for batch in batches] == [1.0, 1.0, 1.0]
    trained = [t.group for batch in batches for t in batch.rollouts[::GROUP]]
    filtered = [p for info in src.infos for p in info.filtered]
    assert not set(trained) & set(filtered) and len(trained) + len(filtered) == len(set(trained + filtered))


def test_streaming_releases_a_group_that_no_later_batch_can_take_while_it_is_in_flight() -> None:
    """A slow first attempt at position 1 (started under policy 0) cannot be in batch 2 or later with
    ``max_staleness=1``: it is released while still in flight, its prompt regenerated under newer weights, and the
    slow call's late result is dropped (every position trained once, the bound kept)."""
    b, n, s = 2, 4, 1
    attempts: dict[int, int] = {}
    lock = threading.Lock()
    release_slow = threading.Event()
    version = [0]

    def group(position: int) -> tuple[list[Trajectory], torch.Tensor]:
        with lock:
            attempts[position] = attempts.get(position, 0) + 1
            attempt = attempts[position]
        if position == 1 and attempt == 1:
            assert release_slow.wait(30)  # finishes only after the run has moved on
        trajs = [
            Trajectory(
                group=position, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0] * 2, versions=[version[0]] * 2
            )
            for _ in range(GROUP)
        ]
        return trajs, torch.full((GROUP,), float(attempt))

    src = StreamingRollouts(
        group_fn=group, load_weights=lambda v: version.__setitem__(0, v), publish_fn=lambda step: None,
        prompts_per_step=b, max_staleness=s, num_batches=n, workers=2,
    )  # fmt: skip
    try:
        batches = []
        for k in range(n):
            batches.append(src.batch(k))
            if k == n - 1:
                release_slow.set()
            src.publish(k + 1)
    finally:
        release_slow.set()
        src.close()
    trained = sorted(t.group for batch in batches for t in batch.rollouts[::GROUP])
    assert trained == list(range(n * b)), trained
    assert attempts[1] == 2 and batches[-1].stats["stream/regenerated"] >= 1
    [retry] = [batch for batch in batches if any(t.group == 1 for t in batch.rollouts)]
    assert float(retry.rewards[[t.group for t in retry.rollouts].index(1)]) == 2.0, "the second attempt is trained"
    for k, info in enumerate(src.infos):
        assert all(k - v <= s for v in info.start_versions), (k, info.start_versions)
