"""One rollout server, several trainer ranks, asynchronous rollouts: every call runs under one weight version.

A vLLM server holds one set of weights. With asynchronous (and streaming) rollouts each trainer rank's generator
threads switch to newer versions on their own schedule, so with several ranks on one server a switch by one rank could
change the weights under another rank's requests. `SharedVersionGate` is the ranks' agreement, kept in a small
`torch.distributed.TCPStore` that trainer rank 0 hosts (a store of its own: the generator threads must not use the
trainer's process group, whose collectives belong to the main threads):

- ``serving``: the version the server serves; ``active``: calls in flight on it, over all ranks and threads.
- A call that needs version ``v`` (`SharedVersionGate.serve`) takes the store's lock, then
  - ``v <= serving``: joins the calls in flight and runs under ``serving`` (versions only move forward, as on every
    engine: the call is fresher than it asked for, and its rollouts carry the version that generated them);
  - ``v > serving`` and no call in flight: switches the server to ``v`` (``switch(v)``, holding the lock, so no call
    starts meanwhile), then runs under it;
  - otherwise it releases the lock and polls again: calls under the older version finish first. They are few and
    finite: once a rank wants ``v`` its new calls all want ``v`` or newer.
- The lock is a compare-and-set on one key (the owner's token, ``"0"`` when free), polled every ``poll_s``.

Every rank may switch the server: the switch is an HTTP request any rank can make (``/update_weights`` of a disk
version that the server reads from the trainer's weights root).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.config import VLLMOptions

__all__ = ["SharedVersionGate", "check_per_call_versions"]

_FREE = "0"


class SharedVersionGate:
    """See the module docstring. Build it with `SharedVersionGate.create` (collective over the trainer's ranks).

    Args:
        store: a ``torch.distributed.Store`` every rank reaches (``compare_set``, ``add``, ``get``, ``set``).
        rank: this trainer rank (part of the lock owner's token).
        poll_s: how often a waiting call looks again.
        timeout_s: how long a call may wait for the lock or for the calls under an older version (then a
            `TimeoutError` that says which version it waited for).
    """

    def __init__(self, store: Any, rank: int, *, poll_s: float = 0.002, timeout_s: float = 600.0) -> None:
        self.store, self.rank, self.poll_s, self.timeout_s = store, rank, poll_s, timeout_s
        self._tokens = itertools.count(1)
        self._token_lock = threading.Lock()
        self.switches = 0
        """Switches this rank made (tests and stats)."""

    @classmethod
    def create(cls, host: str, *, timeout_s: float = 600.0) -> SharedVersionGate:
        """Rank 0 hosts the store on ``host`` (a free port) with ``serving`` = 0 and no call in flight; the port is
        broadcast (collective, main thread) and every rank connects."""
        from datetime import timedelta

        rank, world = dist.get_rank(), dist.get_world_size()
        store: Any = None
        port = 0
        if rank == 0:
            store = dist.TCPStore(host, 0, world, True, timedelta(seconds=timeout_s), wait_for_workers=False)
            store.set("lock", _FREE)
            store.set("serving", "0")
            store.set("active", "0")
            port = int(store.port)
        shared: list[Any] = [host, port]
        dist.broadcast_object_list(shared, src=0)
        if rank != 0:
            store = dist.TCPStore(str(shared[0]), int(shared[1]), world, False, timedelta(seconds=timeout_s))
        dist.barrier()  # every rank connected before any generator uses it
        return cls(store, rank, timeout_s=timeout_s)

    @contextlib.contextmanager
    def serve(self, version: int, switch: Callable[[int], None]) -> Iterator[int]:
        """Run the ``with`` body as a call that needs at least ``version``; yields the version the server serves
        for it (``switch(v)`` makes the server serve ``v``; called with the lock held and no call in flight)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._locked(deadline):
                serving = int(self.store.get("serving"))
                if version <= serving:
                    self.store.add("active", 1)
                    break
                if int(self.store.get("active")) == 0:
                    switch(version)
                    self.switches += 1
                    self.store.set("serving", str(version))
                    self.store.add("active", 1)
                    serving = version
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {self.rank}: waited {self.timeout_s:.0f} s for the rollout server's calls under version "
                    f"{serving} to finish before switching it to version {version}"
                )
            time.sleep(self.poll_s)
        try:
            yield serving
        finally:
            self.store.add("active", -1)

    def serving(self) -> int:
        """The version the server serves now."""
        return int(self.store.get("serving"))

    @contextlib.contextmanager
    def _locked(self, deadline: float) -> Iterator[None]:
        with self._token_lock:
            token = f"{self.rank}:{next(self._tokens)}"
        while self.store.compare_set("lock", _FREE, token).decode() != token:
            if time.monotonic() > deadline:
                owner = self.store.get("lock").decode()
                raise TimeoutError(
                    f"rank {self.rank}: waited {self.timeout_s:.0f} s for the rollout server's version lock "
                    f"(held by rank:call {owner})"
                )
            time.sleep(self.poll_s)
        try:
            yield
        finally:
            self.store.set("lock", _FREE)


def check_per_call_versions(options: VLLMOptions, publishes_directly: bool, chunks: ChunkedGeneration | None) -> None:
    """What asynchronous rollouts on a vLLM server shared by several ranks cannot do yet (one line each)."""
    refusals = [
        (publishes_directly, "loads disk versions per call: set rollout.vllm.weight_transport=auto or disk"),
        (
            options.on_server_failure == "restart",
            "does not restart the server yet (the ranks agree on restarts per synchronous round): set "
            "rollout.vllm.on_server_failure=error",
        ),
        (options.enable_sleep_mode, "keeps the server awake: set rollout.sleep=false"),
        (chunks is not None, "does not interrupt generations: set rollout.partial_rollouts=false"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"asynchronous rollouts on a vLLM server shared by several trainer ranks {why}")
