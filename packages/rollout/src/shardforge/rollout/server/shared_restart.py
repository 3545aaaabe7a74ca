"""Restarting a rollout server that several trainer ranks share (``rollout.vllm.on_server_failure: restart``).

Global rank 0 starts one server and every rank sends its own requests to it, so any rank's request
may be the one that finds the server dead, while rank 0 (the only rank that can restart it) may be
sending its own requests, scoring, or already waiting for the next collective. The ranks therefore
agree on restarts at one point that every rank reaches exactly once per **generation round** (one
round = this rank's share of a step's episodes, of one dynamic-sampling round, or of one evaluation),
never inside per-request code (a multi-turn rank makes a different number of requests than its peers):

1. inside the round, a rank whose request fails (or whose ``/health`` check fails) does not recover:
   the engine raises `ServerDownOnThisRank` (every later request of the round fails at once, without
   touching the server), which ends the rank's episodes; its results are discarded.
2. at the round's end every rank joins one all-reduce of a "my round failed" flag (a few bytes per
   round; nothing more when nobody failed). Every rank has finished or abandoned its requests by then,
   so no rank has a request in flight when rank 0 restarts the server.
3. if some rank failed, the failing ranks' reasons are gathered; rank 0 restarts the server, gives it
   the weight-transfer root and switches it to the current weight version (the version every rank's
   round used), or, when ``rollout.vllm.max_server_restarts`` is used up or the restart fails, writes the
   one-line error. It broadcasts the outcome: every rank raises the same one-line error (no rank is
   left waiting), or counts the restart (so every rank's count, which ``max_server_restarts`` limits,
   is the same; only rank 0 reports it in ``rollout_server/restarts``, the sum over ranks is then the
   number of restarts). With ``rollout.vllm.weight_transport: collective`` the current version exists only in
   the trainer's shards: every rank then joins its gathers and rank 0 sends it to the restarted server
   (``restore_weights``); a server that fails that too is stopped, and the next round restarts it again.
4. the failing ranks run their round again from the start, with the same seeds at the same weight
   version: whole groups are regenerated (no group mixes samples of the dead server with new ones), and
   they equal what a healthy server would have returned. Ranks whose round succeeded keep it (they
   sampled from the live server, at the same version). Then the ranks agree again (a server may die twice).

A rank also notices a failure that its workflow swallowed (an evaluation scores a crashed episode 0,
``workflow.max_failed_fraction`` drops a crashed group): the engine records every failure of the round.
With a trainer world size of 1 the engine restarts the server itself, inside the request
(`VLLMServerRolloutEngine`). A server given by URL is never restarted: the ranks still agree, and every
rank raises the one-line error that says so. The vLLM server actor's server (``rollout.placement:
disaggregated``, `shardforge.rollout.ray.vllm_server`) is restarted the same way: rank 0's
``restart_server`` asks the actor, once per agreed restart; no other rank asks it.

Steps 1, 2 and 4 are `RoundAgreement`'s; step 3 is the subclass's: `SharedServerRestarts` restarts the server,
`rollout.actor_pool.ActorPool` (HF rollout actors, ``rollout.on_actor_failure: drop``) drops the dead actors
and moves their ranks to live ones.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import NoReturn, Protocol, TypeVar

import torch.distributed as dist

from shardforge.core.log import get_logger
from shardforge.mesh.collectives import all_reduce_max
from shardforge.rollout.server.health import HealthCounters, RolloutServerError

__all__ = ["RestartableServer", "RoundAgreement", "ServerDownOnThisRank", "SharedServerRestarts", "generation_round"]

T = TypeVar("T")
log = get_logger(__name__)


class ServerDownOnThisRank(RolloutServerError):
    """This rank's request to a shared rollout server failed inside a generation round: the rank stops the
    round, and the ranks agree on a restart at its end (`SharedServerRestarts.run`)."""


class RestartableServer(Protocol):
    """What `SharedServerRestarts` needs from the engine of a server that rank 0 started."""

    url: str
    health: HealthCounters
    requests_sent: int
    """Completion requests sent so far (resent ones are counted as ``rollout_server/resent_requests``)."""

    @property
    def restartable(self) -> bool:
        """Rank 0: whether this trainer started the server (a server given by URL is never restarted)."""

    def restart_server(self) -> None:
        """Rank 0: restart the server and bring it to the current weight version (raises if it cannot), unless only
        every rank together can (`restore_weights`)."""

    def restore_weights(self) -> None:
        """Every rank, after the restart: bring the server to the current version where rank 0 alone could not
        (weights sent over the collective transport are gathered from every rank's shards); else a no-op."""

    def down_error(self, reason: str) -> str:
        """Rank 0: the one-line error when the server is not restarted (given by URL, or restarts used up)."""


def generation_round(rollout: object, fn: Callable[[], T]) -> T:
    """``fn()``: one generation round of this rank (its requests, episodes, rewards; no collectives inside).
    When ``rollout`` has a `RoundAgreement` (``rollout.shared_restarts``: a server shared by several ranks with
    ``on_server_failure: restart``, or a pool of rollout actors with ``rollout.on_actor_failure: drop``,
    `rollout.actor_pool`), this is collective over all ranks: see the module docstring. Otherwise it is ``fn()``."""
    agreement: RoundAgreement | None = getattr(rollout, "shared_restarts", None)
    return fn() if agreement is None else agreement.run(fn)


class RoundAgreement(abc.ABC):
    """The ranks' agreement once per generation round (steps 1, 2 and 4 of the module docstring): run this rank's
    round, all-reduce whether it failed, recover (`_agree`, step 3: the subclass's) and run the failing ranks'
    rounds again, until every rank's round succeeded."""

    thread_refusal = "use rollout.vllm.on_server_failure: error"
    """How to avoid the agreement when a round runs on a background thread (the end of that one-line error)."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._in_round = False
        self._down: str | None = None
        """Why this rank's requests failed in the current round (None: they did not)."""

    def _requests_sent(self) -> int:
        """Requests sent so far (the ones a regenerated round sends are counted as resent)."""
        return 0

    def _count_resent(self, count: int) -> None:  # noqa: B027  (an optional hook: nothing to count by default)
        """A regenerated round sent ``count`` requests again."""

    @abc.abstractmethod
    def _agree(self, reason: str | None) -> None:
        """Some rank's round failed (this rank's: ``reason``): recover, or raise the same error on every rank."""

    # ------------------------------------------------------------------ the round (the trainer)
    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` (this rank's round), run again after a recovery until every rank's round succeeded.
        Collective over all ranks, on the main thread; raises `RolloutServerError` on every rank when the
        ranks cannot recover."""
        if self._in_round:  # a round inside a round: the outer one agrees
            return fn()
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "the ranks sharing rollout servers agree on failures with collectives, which cannot run on a "
                f"background thread (async_rollouts with several ranks); {self.thread_refusal}"
            )
        result: T | None = None
        done = regenerating = False
        while True:
            reason = None
            if not done:
                reason, result = self._attempt(fn, regenerating)
                done = reason is None
            group = dist.group.WORLD if dist.is_initialized() else None
            (failed,) = all_reduce_max(0.0 if done else 1.0, group=group)
            if failed == 0.0:
                return result  # type: ignore[return-value]
            self._agree(reason)
            regenerating = not done

    def _attempt(self, fn: Callable[[], T], regenerating: bool) -> tuple[str | None, T | None]:
        """(None, fn()) or (why this rank's requests failed, None)."""
        sent = self._requests_sent()
        self._in_round, self._down = True, None
        result = None
        try:
            result = fn()
        except Exception:
            if self._down is None:  # not the server: raise as without the agreement
                raise
        finally:
            self._in_round = False
            if regenerating:
                self._count_resent(self._requests_sent() - sent)
        return self._down, (result if self._down is None else None)


class SharedServerRestarts(RoundAgreement):
    """The agreement on restarts of one server shared by all ``world_size`` ranks (global rank 0 started it, or
    it was given by URL: then every rank raises the one-line error that says it cannot be restarted)."""

    def __init__(self, server: RestartableServer, *, rank: int, world_size: int, max_restarts: int) -> None:
        super().__init__(rank=rank, world_size=world_size)
        self.server, self.max_restarts = server, max_restarts

    def _requests_sent(self) -> int:
        return self.server.requests_sent

    def _count_resent(self, count: int) -> None:
        self.server.health.add("resent_requests", count)

    # ------------------------------------------------------------------ inside a round (the engine)
    def server_down(self, reason: str) -> NoReturn:
        """Called by the engine when a request or ``/health`` failed; raises (never restarts here)."""
        if not self._in_round:
            raise RolloutServerError(
                f"rollout server {self.server.url} is down: {reason}; it is shared by {self.world_size} ranks, which "
                "restart it only at the end of a generation round (`shardforge.rollout.server.shared_restart.generation_round`), and "
                "this request was sent outside one"
            )
        if self._down is None:
            self._down = reason
        raise ServerDownOnThisRank(f"rollout server {self.server.url} is down: {self._down}")

    def raise_if_down(self) -> None:
        """Fail a request at once when an earlier one of the round found the server down."""
        if self._in_round and self._down is not None:
            raise ServerDownOnThisRank(f"rollout server {self.server.url} is down: {self._down}")

    def _agree(self, reason: str | None) -> None:
        """Some rank's round failed: rank 0 restarts the server or writes the error; every rank learns which."""
        reasons: list[str | None] = [None] * self.world_size
        dist.all_gather_object(reasons, reason)
        outcome: list[str | None] = [None]
        if self.rank == 0:
            failing = [r for r, why in enumerate(reasons) if why is not None]
            why = f"{reasons[failing[0]]} (seen by rank(s) {failing})"
            left = self.max_restarts - self.server.health.total_restarts
            if left <= 0 or not self.server.restartable:
                outcome[0] = self.server.down_error(why)
            else:
                log.warning(f"rollout server {self.server.url} is down: {why}; restarting it ({left} restarts left)")
                try:
                    self.server.restart_server()
                except Exception as exc:  # every rank must hear of it, or the others wait forever
                    first_line = (str(exc).splitlines() or [""])[0]
                    outcome[0] = (
                        f"rollout server {self.server.url} is down: {why}; restarting it failed: "
                        f"{type(exc).__name__}: {first_line}"
                    )
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise RolloutServerError(outcome[0])
        self.server.health.add_restart(in_metrics=self.rank == 0)
        self.server.restore_weights()  # collective: before any rank samples from the restarted server
