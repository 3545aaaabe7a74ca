"""A pool of HF rollout actors that drops a dead one (``rollout.on_actor_failure: drop``, issue 21).

With ``rollout.placement: disaggregated`` and ``rollout.engine: hf``, trainer rank ``r`` generates through rollout
actor ``r % rollout.num_actors`` (`rollout.placement.actor_for_rank`), and every actor serves the same weight
version (trainer rank 0 publishes each version to all of them, `rollout.ray_rollout`). When an actor dies (its
process is killed, runs out of memory, its node goes away), ``rollout.on_actor_failure`` says what the ranks do:

- ``error`` (the default): the rank that called it raises a one-line error naming the actor, and the run ends.
- ``drop`` (``rollout.num_actors >= 2``): the ranks agree on the dead actors once per generation round, with the
  round agreement of a shared rollout server (`rollout.shared_restart.RoundAgreement`): a rank whose call finds
  its actor dead abandons its round (every later call of the round fails at once); at the round's end one
  all-reduce tells every rank whether some rank failed, and when one did the ranks all-gather which actors they
  found dead. Every rank then drops the same actors from the pool (the live actors, in index order), and a rank
  whose actor is gone moves to live actor ``live[rank % len(live)]`` (ranks on a live actor stay where they are:
  the same reassignment on every rank, computed from agreed data). The failing ranks run their whole round again
  there, with the same seeds at the same weight version: whole groups are regenerated, equal to what the dead
  actor would have returned. When no actor is left, every rank raises the same one-line error.

Trainer rank 0 also asks the live actors whether they are alive before each weight publish (a dead one would
keep the collective transport's group from forming until its timeout): ``drop`` drops the dead ones there (the
other ranks learn the pool at the publish's end), ``error`` raises at once. The next publish builds the group of
rank 0 and the live actors only. An actor that dies while it receives a version ends the run (the transfer has
no way to finish without it). Counts are ``rollout_actors/*`` metrics (`pop_stats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch.distributed as dist

from shardforge.core.log import get_logger
from shardforge.rollout.ray.placement import actor_for_rank
from shardforge.rollout.server.health import RolloutServerError
from shardforge.rollout.server.shared_restart import RoundAgreement, ServerDownOnThisRank

__all__ = ["ActorPool"]

log = get_logger(__name__)


class ActorPool(RoundAgreement):
    """The live rollout actors (by index into ``names``), the one this rank generates through, and the ranks'
    agreement on dropping dead ones (``drop=False``: a dead actor is an error; see the module docstring)."""

    thread_refusal = "use rollout.on_actor_failure: error"

    def __init__(self, names: Sequence[str], *, rank: int, world_size: int, drop: bool) -> None:
        super().__init__(rank=rank, world_size=world_size)
        self.names = list(names)
        self.drop = drop
        self.live = list(range(len(self.names)))
        """The actors every rank still uses, in index order (rank 0 publishes to exactly these)."""
        self.current = actor_for_rank(rank, len(self.names))
        """The actor this rank generates through."""
        self.calls = 0
        """Calls this rank made to its actor (a regenerated round's are counted as resent)."""
        self._found_dead: set[int] = set()
        """Actors this rank found dead that the ranks have not dropped yet."""
        self._counts = {"dropped": 0, "resent_requests": 0}

    # ------------------------------------------------------------------ a call found an actor dead
    def actor_died(self, index: int, error: RolloutServerError) -> NoReturn:
        """Actor ``index`` is dead (``error``: ray_get's one line). ``drop`` inside a round: remember it and end
        this rank's round (`ServerDownOnThisRank`); otherwise raise the one-line error."""
        if not self.drop:
            raise RolloutServerError(
                f"{str(error).rstrip('.')}; set rollout.on_actor_failure: drop (rollout.num_actors >= 2) to go on "
                "without it"
            ) from error
        self._found_dead.add(index)
        if not self._in_round:
            raise RolloutServerError(
                f"{error}; the ranks drop a dead rollout actor only at the end of a generation round "
                "(`shardforge.rollout.server.shared_restart.generation_round`), and this call was made outside one"
            ) from error
        if self._down is None:
            self._down = str(error)
        raise ServerDownOnThisRank(self._down) from error

    def raise_if_down(self) -> None:
        """Fail a call at once when an earlier one of the round found this rank's actor dead."""
        if self._in_round and self._down is not None:
            raise ServerDownOnThisRank(self._down)

    # ------------------------------------------------------------------ the agreement (the trainer)
    def _requests_sent(self) -> int:
        return self.calls

    def _count_resent(self, count: int) -> None:
        self._counts["resent_requests"] += count

    def _agree(self, reason: str | None) -> None:
        """Some rank's round failed: every rank learns which actors the ranks found dead and drops them."""
        mine = (reason, sorted(self._found_dead))
        seen: list[tuple[str | None, list[int]] | None] = [mine]
        if dist.is_initialized() and self.world_size > 1:
            seen = [None] * self.world_size
            dist.all_gather_object(seen, mine)
        failing = [r for r, item in enumerate(seen) if item is not None and item[0] is not None]
        why = f"{seen[failing[0]][0]} (seen by rank(s) {failing})"  # type: ignore[index]
        dead = sorted({index for item in seen if item is not None for index in item[1]})
        self.drop_actors(dead, why)

    def drop_actors(self, dead: Sequence[int], why: str) -> None:
        """Drop the actors ``dead`` from the pool on this rank (every rank must drop the same ones, in the same
        order of calls); raise the one-line error when none is left. ``why``: the first failure, for the log."""
        self._found_dead -= set(dead)
        gone = [index for index in self.live if index in dead]
        live = [index for index in self.live if index not in dead]
        if not gone:  # only a live actor's death fails a round; anything else is a bug, not a reason to loop
            raise RolloutServerError(f"{why}; but no live rollout actor was found dead (live: {self._named(live)})")
        if not live:
            raise RolloutServerError(
                f"{why}; no rollout actor is left (all {len(self.names)} died, the last: {self._named(gone)}): check "
                "the actors' logs in the Ray session's logs directory (out of memory? killed?) and rerun, with more "
                "rollout.num_actors or memory"
            )
        if self.rank == 0:
            log.warning(
                f"dropping rollout actor(s) {self._named(gone)} from the pool: {why}; {len(live)} of "
                f"{len(self.names)} left ({self._named(live)}), which serve the ranks that used it from now on"
            )
            self._counts["dropped"] += len(gone)  # rank 0 alone: the sum over ranks is the number dropped
        self.live = live
        if self.current not in live:
            self.current = live[self.rank % len(live)]

    def set_live(self, live: Sequence[int]) -> None:
        """Rank 0's pool after a publish (it dropped actors it found dead there): the same on this rank."""
        dead = [index for index in self.live if index not in live]
        if dead:
            self.drop_actors(dead, "found dead by rank 0 before a weight publish")

    def pop_stats(self) -> dict[str, float]:
        """``rollout_actors/dropped`` (rank 0's count; summed over ranks, the actors dropped), ``rollout_actors/live``
        (rank 0's; likewise) and ``rollout_actors/resent_requests`` (this rank's calls in regenerated rounds), since
        the last call."""
        counts, self._counts = self._counts, {"dropped": 0, "resent_requests": 0}
        live = float(len(self.live)) if self.rank == 0 else 0.0
        return {
            "rollout_actors/dropped": float(counts["dropped"]),
            "rollout_actors/live": live,
            "rollout_actors/resent_requests": float(counts["resent_requests"]),
        }

    def _named(self, indices: Sequence[int]) -> str:
        return ", ".join(self.names[i] for i in indices) or "none"
