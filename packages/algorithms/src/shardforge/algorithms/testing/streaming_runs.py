"""Shared pieces of the streaming-rollout tests (GRPO and PPO): a run that dies right after a checkpoint with
prompts in flight, its resume, and the checks on the per-rank stream records that make the resume lossless; a
deterministic partial-rollout interruption (`interrupt_every_later_call`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["check_lossless_stream", "die_after_checkpoint_then_resume", "interrupt_every_later_call"]


class _Stop(Exception):
    pass


def die_after_checkpoint_then_resume(
    trainer_cls: Any, run: Callable[[], dict[str, Any]], cut: int, monkeypatch: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``run()`` raises at step ``cut`` (just after the step-``cut`` checkpoint), then runs again and resumes.

    Returns the one checkpoint's extra state (asserted to hold prompts to regenerate) and the resumed run's result.
    """
    train_step, extra_state = trainer_cls.train_step, trainer_cls.extra_state
    saved: list[dict[str, Any]] = []

    def stop_after_cut(self: Any, step: int) -> dict[str, float]:
        if step == cut:  # the run dies after the step-`cut` checkpoint, with prompts in flight
            raise _Stop
        return train_step(self, step)

    def recording(self: Any) -> dict[str, Any]:
        state = extra_state(self)
        saved.append(state)
        return state

    monkeypatch.setattr(trainer_cls, "train_step", stop_after_cut)
    monkeypatch.setattr(trainer_cls, "extra_state", recording)
    try:
        run()
    except _Stop:
        pass
    else:
        raise AssertionError(f"the run did not reach step {cut}")
    [state] = saved
    [mine] = state["streaming_rollouts"]["ranks"]
    assert mine["regenerate"], "prompts were in flight or finished-unused at the checkpoint"
    monkeypatch.setattr(trainer_cls, "train_step", train_step)
    return state, run()


def check_lossless_stream(records: list[dict[str, Any]], steps: int, prompts: int, cut: int) -> None:
    """A rank's stream records (``streaming/rank{R}.jsonl``) of a run resumed after step ``cut`` at staleness 1:
    every batch once, every prompt position trained exactly once, no trajectory more than one version stale, and
    everything trained after the resume started under the checkpoint's weights or newer."""
    assert [r["batch"] for r in records] == list(range(steps))
    positions = [p for r in records for p in r["positions"]]
    assert sorted(positions) == list(range(steps * prompts)), "every prompt position trained exactly once"
    for r in records:
        assert all(r["batch"] - v <= 1 for v in r["start_versions"]), r
        if r["batch"] >= cut:  # regenerated or new after the resume: the checkpoint's weights or newer
            assert min(r["start_versions"]) >= cut, r


def interrupt_every_later_call(between_chunks: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A `StreamingSource._between_chunks` (``between_chunks``: the original) that makes "the trainer published while
    the group generated" deterministic: at the first chunk boundary of every call after the first batch's, it waits
    until the policy after the call's start version is published (the trainer needs only the previous call's groups
    to get there), then does what the source does there. Monkeypatch it onto `StreamingSource`."""
    gated: dict[int, Any] = {}

    def gate(self: Any) -> bool:
        groups = self.stream._call.groups
        if groups and groups[0].position >= self.local and gated.get(threading.get_ident()) is not groups:
            gated[threading.get_ident()] = groups
            deadline = time.monotonic() + 120  # a guard against a hang, not a timed assertion
            while max(self._versions) <= groups[0].start_version:
                assert time.monotonic() < deadline, "the trainer never published"
                time.sleep(0.005)
        return bool(between_chunks(self))

    return gate
