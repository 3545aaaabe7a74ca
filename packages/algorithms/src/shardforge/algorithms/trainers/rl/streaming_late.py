"""What streaming rollouts do with a LATE group: one started under policy ``v`` that has not finished when batch
``v + max_staleness`` (the last batch the staleness bound lets take it) is assembled (``rollout.streaming_late_groups``).

- ``wait`` (the default): batch ``v + max_staleness`` waits for it. The admission rule guarantees room: the
  unconsumed groups started at or before ``k - max_staleness`` are never more than one batch (prompts started under
  policy <= v number at most ``(max_staleness + v + 1) * prompts_per_step``; batches ``< v + max_staleness`` took
  ``(v + max_staleness) * prompts_per_step``), so batch k can take all of them. Nothing generated is thrown away and
  nothing piles up at the end of a run; the trainer's wait is the late group's remaining decode.
- ``defer``: the group is released (its late result dropped, a partial-rollout call stops at its next chunk
  boundary) and its prompt is started again only after the run's last fresh prompt. Long tails then run together
  at the end of the run, where the last batches wait once for all of them; until then their places in flight go to
  fresh prompts. The deferred prompts are the run's slowest, so they cluster in its last steps.
- ``regenerate``: released, and its prompt started again at once under newer weights (the behaviour before this
  option). If the prompt's response is long every time, it is released again and again and holds a place in flight
  until the last batch needs it.

AReaL bounds only admission and never discards a late trajectory: it trains it whenever it finishes, so a group can
be more stale than the bound. All three policies here keep the bound strict (no trained group more than
``max_staleness`` steps stale, counted from its start version); ``wait`` is the closest to AReaL's "never discard"
(benchmarks/bench_streaming.py compares them; ``docs/packages/algorithms-grpo.md``, streaming).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from shardforge.rollout.config import STREAMING_LATE_GROUPS

__all__ = ["LATE_GROUPS", "PromptOrder", "check_late_groups"]

LATE_GROUPS = STREAMING_LATE_GROUPS
"""The valid ``late_groups`` policies (the module docstring; ``rollout.streaming_late_groups``)."""


def check_late_groups(late_groups: str) -> None:
    if late_groups not in LATE_GROUPS:
        raise ValueError(f"late_groups={late_groups!r} is not a late-group policy; valid: {', '.join(LATE_GROUPS)}")


class PromptOrder:
    """The order in which the streaming generator starts prompt positions: the checkpoint's and the released ones
    to regenerate first (``regenerate``), fresh positions, and with ``defer`` the released ones once the fresh
    positions of the run (``< end``) are all started. Not thread-safe (the caller holds its lock).

    Args:
        late_groups: one of `LATE_GROUPS`.
        restored: positions to regenerate first (a checkpoint's).
        next_position: the first fresh position.
        end: one past the run's last fresh position (prompts beyond it are drawn only to replace groups dynamic
            sampling dropped; deferred prompts go before them).
        flush_at: with ``defer``: once this many positions are deferred, they are all started again (together).
    """

    def __init__(
        self, *, late_groups: str, restored: Iterable[int], next_position: int, end: int, flush_at: int
    ) -> None:
        check_late_groups(late_groups)
        self.late_groups, self.end, self.flush_at = late_groups, end, flush_at
        self.next_position = next_position
        self._first: deque[int] = deque(restored)
        self._deferred: deque[int] = deque()
        self._draining = False
        self._retries: set[int] = set()  # deferred positions started again (their second attempt is waited for)

    def take(self) -> int:
        """The next position to start."""
        if self._first:
            return self._first.popleft()
        if self._deferred and (
            self._draining or len(self._deferred) >= self.flush_at or self.next_position >= self.end
        ):
            self._draining = len(self._deferred) > 1  # the whole deferred set starts together
            position = self._deferred.popleft()
            self._retries.add(position)
            return position
        self.next_position += 1
        return self.next_position - 1

    def release(self, position: int) -> None:
        """``position``'s group was released (too stale): start it again (``regenerate``: next; ``defer``: with the
        other deferred ones; ``wait`` releases only what the bound forces, and regenerates it next)."""
        if self.late_groups == "defer":
            self._retries.discard(position)
            self._deferred.append(position)
        else:
            self._first.appendleft(position)

    def waits_for(self, position: int) -> bool:
        """Whether the batch that is the last one the bound allows for ``position``'s group waits for it."""
        return self.late_groups == "wait" or position in self._retries

    def done(self, position: int) -> None:
        """``position`` was trained or dropped."""
        self._retries.discard(position)

    def pending(self) -> list[int]:
        """Positions released or restored and not started again."""
        return [*self._first, *self._deferred]
