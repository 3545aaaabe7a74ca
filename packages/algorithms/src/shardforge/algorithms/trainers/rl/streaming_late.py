"""What streaming rollouts do with a LATE group (``rollout.streaming_late_groups``): one started under policy ``v``
that is still generating when batch ``v + max_staleness``, the last one its staleness bound allows, is assembled.

- ``defer`` (the default): the group is released (its late result dropped; with partial rollouts its call stops at
  the next chunk boundary) and its prompt waits; the deferred prompts start again all together once a batch's worth
  (``prompts_per_step`` per rank) is deferred or the run's fresh prompts are all started, and this second attempt
  is never released: the batch its bound ends at waits for it. A long tail then costs the trainer one wait per
  batch's worth of late prompts (the longest of them), instead of one per late prompt, and until then its place in
  flight goes to a fresh prompt. Price: a late prompt is generated twice (the first attempt only up to its release)
  and trained some steps later than its position (at most about a batch's worth of late prompts later, or in the
  run's last steps).
- ``wait``: never released; batch ``v + max_staleness`` waits for it. Nothing generated is thrown away, but the
  trainer waits for each late group on its own.
- ``regenerate``: released and started again at once under newer weights (the only behaviour before this option).
  A prompt whose responses are always long is released again and again, holds a place in flight all run, and the
  run's last batch waits for it.

Room for the waits: prompts started under policy <= v number at most ``(max_staleness + v + 1) * prompts_per_step``
(the admission rule) and batches before ``v + max_staleness`` took ``(v + max_staleness) * prompts_per_step``, so
the unconsumed groups that batch ``v + max_staleness`` must take are never more than one batch.

AReaL bounds only admission and never discards a late trajectory: it trains it whenever it finishes, so a trained
group can be more stale than the bound. Here every policy keeps the bound strict (no trained group more than
``max_staleness`` steps stale, counted from its start version); ``wait`` is the closest to AReaL's "never discard".
Measured (benchmarks/bench_streaming.py, ``late_groups_steps``; ``docs/packages/algorithms-grpo.md``, streaming).
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
