"""What an OpenAI-compatible endpoint served, per episode, as token-exact trajectories.

Every completion the endpoint returns is recorded with the prompt ids as the engine encoded them, the ids
it generated, their behaviour log-probs and the weight version. The turns of one episode become
`Trajectory` objects without re-tokenising anything:

- a turn whose prompt ids start with an open trajectory's ids (the previous prompt + completion, as the
  client sent the conversation back) extends that trajectory: the new prompt tokens (tool results, the
  user's turn, the template's markers) are appended with loss mask 0, the generated ones with mask 1;
- a turn that extends none (the client rewrote or truncated its history, or re-rendered an earlier
  completion into other tokens) starts a new trajectory of the same episode and is counted in
  ``rewrites``: never silently re-encoded;
- the ``n`` choices of one request branch from the same trajectory (each its own trajectory).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from shardforge.rollout.episodes.trajectory import Trajectory, TurnInfo
from shardforge.rollout.types import Rollout

__all__ = ["EpisodeRecord", "EpisodeRecorder", "Turn"]


@dataclass(frozen=True, slots=True)
class Turn:
    """One completion the endpoint returned."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    finished: bool


@dataclass(slots=True)
class EpisodeRecord:
    """The turns of one episode and the trajectories they make."""

    turns: list[Turn] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)
    rewrites: int = 0
    """Turns that extended no open trajectory of this episode (history rewritten or re-encoded by the client)."""


def _extends(trajectory: Trajectory, prompt_ids: Sequence[int]) -> bool:
    ids = trajectory.token_ids
    return len(prompt_ids) >= len(ids) and list(prompt_ids[: len(ids)]) == ids


def _fresh(prompt_ids: Sequence[int]) -> Trajectory:
    n = len(prompt_ids)
    return Trajectory(group=0, token_ids=list(prompt_ids), loss_mask=[0] * n, logprobs=[0.0] * n, versions=[-1] * n)


def _copy(trajectory: Trajectory) -> Trajectory:
    return Trajectory(
        group=trajectory.group, token_ids=list(trajectory.token_ids), loss_mask=list(trajectory.loss_mask),
        logprobs=list(trajectory.logprobs), versions=list(trajectory.versions), turns=list(trajectory.turns),
    )  # fmt: skip


class EpisodeRecorder:
    """Thread-safe record of every episode's turns (`record`) and their trajectories (`pop`)."""

    def __init__(self) -> None:
        self._episodes: dict[Hashable, EpisodeRecord] = {}
        self._lock = threading.Lock()

    def record(self, episode: Hashable, prompt_ids: Sequence[int], rollouts: Sequence[Rollout]) -> None:
        """The ``n`` choices (``rollouts``) of one request of ``episode`` on ``prompt_ids``."""
        with self._lock:
            record = self._episodes.setdefault(episode, EpisodeRecord())
            base = max(
                (t for t in record.trajectories if _extends(t, prompt_ids)),
                key=lambda t: len(t.token_ids),
                default=None,
            )
            if base is None and record.trajectories:
                record.rewrites += 1
            start = _copy(base) if base is not None else None
            for index, rollout in enumerate(rollouts):
                turn = Turn(list(prompt_ids), list(rollout.response_ids), list(rollout.logprobs), rollout.version,
                            rollout.finished)  # fmt: skip
                record.turns.append(turn)
                if start is None:
                    trajectory = _fresh(prompt_ids)
                    record.trajectories.append(trajectory)
                elif index == 0 and base is not None:
                    trajectory = base
                else:  # another choice of the same request: a branch from the state before it
                    trajectory = _copy(start)
                    record.trajectories.append(trajectory)
                trajectory.append(list(prompt_ids[len(trajectory.token_ids) :]))
                trajectory.append(turn.completion_ids, logprobs=turn.logprobs, version=rollout.versions)
                trajectory.turns.append(TurnInfo(generated=len(turn.completion_ids), finished=rollout.finished))
                trajectory.text = rollout.text

    def get(self, episode: Hashable) -> EpisodeRecord | None:
        with self._lock:
            return self._episodes.get(episode)

    def pop(self, episode: Hashable) -> EpisodeRecord:
        """The episode's record, removed (an episode never seen: an empty record)."""
        with self._lock:
            return self._episodes.pop(episode, EpisodeRecord())

    def episodes(self) -> list[Hashable]:
        with self._lock:
            return list(self._episodes)
