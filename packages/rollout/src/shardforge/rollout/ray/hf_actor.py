"""Disaggregated rollouts under Ray: the embedded HF engine in an actor of its own, and the trainer's client.

- `RolloutActor` (started by `shardforge.algorithms.launch.ray`, one per ``rollout.num_actors``) wraps an
  unmodified `HFRolloutEngine` and serves the `RolloutEngine` request/response interface as actor methods:
  ``generate(prompts, params, sessions) -> list[Rollout]`` (the same rollouts, tagged with the serving
  version, as the engine gives in process) and ``receive_weights``, which joins trainer rank 0's weight-sync
  `CollectiveTransport` group as a `CollectiveReceiver` and applies one version (manifest-checked, crc32
  verified, staged then switched at COMMIT; a refused version leaves the previous one serving).
- `RayRolloutClient` is the trainer ranks' `RolloutEngine`: ``generate`` is a call to its actor;
  ``publish`` is collective over the trainer ranks: rank 0 asks every actor to receive, gathers the weights
  bucket by bucket through ``engine.publish_weights`` into the collective transport, waits until every actor
  serves the version, then all ranks pass a barrier (no rank samples from the previous version) — the
  vLLM server path's protocol (`rollout.vllm_server`), with the collective transport instead of disk.
- A dead actor (``rollout.on_actor_failure``): a one-line error naming it (``error``), or the ranks drop it from
  the pool at the end of the generation round, move its ranks to a live actor and regenerate their round there;
  later publishes go to the live actors only (``drop``, `rollout.actor_pool`).
- Asynchronous and streaming rollouts (the client built with ``weights_root``): the trainer publishes every version
  to disk (weight-sync `DiskTransport`, as for a colocated engine), `RayRolloutClient.update_weights` only records
  the version this rank's next calls need (no collective: the generator thread calls it), and every ``generate``
  names it; the actor loads that disk version before the call when it serves an older one. An actor runs one call
  at a time (Ray's default concurrency), so no call runs under two versions, and several ranks (or generator
  threads) can share one actor. Versions only move forward: a call that names an older version than the actor
  serves (another rank's call loaded a newer one) runs under the served one, and its rollouts carry that version
  (``Rollout.version``; the decoupled loss uses each rollout's own behaviour log-probs, so it stays exact; the
  batch is fresher than the staleness bound asks). On several Ray nodes ``weights_root`` (``output_dir/weights``)
  must be on storage the trainer's rank 0 and the actors share, as for the vLLM server's disk versions.
- Partial rollouts (``rollout.partial_rollouts``, ``spec.interrupt_chunk_tokens`` > 0): the actor's engine generates in
  chunks, and between two chunks of a call the actor loads the newest published disk version (AReaL's interruption at
  a weight update); the unfinished rows continue under it and every token keeps the version that sampled it.

Sampling is seeded per request (`rollout.seeds`), so the actor samples what the colocated engine would.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardforge.core import hooks
from shardforge.core.log import get_logger
from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.ray.actor_pool import ActorPool
from shardforge.rollout.server.health import RolloutServerError, ray_get
from shardforge.rollout.types import Rollout, SamplingParams
from shardforge.weight_sync import DiskWeightSource, WeightVersionError

__all__ = ["RayRolloutClient", "RolloutActor"]

log = get_logger(__name__)


class RolloutActor:
    """One rollout engine as a Ray actor (the class is wrapped with ``ray.remote`` by the launcher)."""

    def __init__(self, spec: Any, index: int) -> None:
        import torch
        from transformers import AutoTokenizer

        from shardforge.mesh import current_device
        from shardforge.rollout.hf.engine import HFRolloutEngine

        torch.set_num_threads(1)  # one bundle = one CPU; the ranks' generate ran single-threaded too
        self.index = index
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer)
        chunk_tokens = int(spec.interrupt_chunk_tokens)
        chunks = ChunkedGeneration(chunk_tokens) if chunk_tokens > 0 else None
        self.engine = HFRolloutEngine(
            spec.model, tokenizer, dtype=spec.dtype, device=current_device(), kv_reuse=spec.kv_reuse,
            kv_reuse_max_tokens=spec.kv_reuse_max_tokens, share_prefill=spec.share_prefill, batch_size=spec.batch_size,
            chunks=chunks,
        )  # fmt: skip
        self._refreshing = contextlib.ExitStack()  # partial rollouts: for the actor's lifetime
        if chunks is not None:
            self._refreshing.enter_context(chunks.refreshing(self._between_chunks))
        self._call_root: str | None = None
        """The disk root the call in progress named (None: none, or versions over the collective transport)."""
        self.switched_mid_call = 0
        """Partial rollouts: chunk boundaries at which a call continued under a newer version."""
        self.receiver: Any = None
        self.address: tuple[str, int, int, int] | None = None
        self.received: list[int] = []
        self.generate_calls = 0
        self.rollouts_by_version: dict[int, int] = {}
        self.sources: dict[str, DiskWeightSource] = {}
        """Asynchronous rollouts: the disk roots calls named (the trainer's ``output_dir/weights``)."""
        self.loaded: list[int] = []
        """Disk versions loaded, in order."""
        self.served_newer = 0
        """Calls that named an older version than the one served (they ran under the newer one)."""

    def ready(self) -> int:
        """The version served (0: the model directory's weights); returns once the engine is built."""
        return int(self.engine.version)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        sessions: list[Hashable | None] | None = None,
        weights: tuple[str, int] | None = None,
    ) -> list[Rollout]:
        """The engine's rollouts of ``prompts``. ``weights``: (disk root, version) the call needs (asynchronous
        rollouts), loaded first when this actor serves an older version (see the module docstring)."""
        self.generate_calls += 1
        hooks.fire("rollout_generate", index=self.index, call=self.generate_calls)  # tests kill the actor here
        if weights is not None:
            self._serve_disk_version(*weights)
        self._call_root = None if weights is None else weights[0]
        try:
            rollouts = self.engine.generate(prompts, params, sessions=sessions)
        finally:
            self._call_root = None
        version = int(self.engine.version)
        self.rollouts_by_version[version] = self.rollouts_by_version.get(version, 0) + len(rollouts)
        return rollouts

    def end_sessions(self, sessions: list[Hashable]) -> None:
        self.engine.end_sessions(sessions)

    def _between_chunks(self) -> bool:
        """Partial rollouts, after a chunk that left unfinished rows: load the newest committed disk version and go on
        (the unfinished rows continue under it, each token tagged with its version). The newest published version may
        always be used: a step publishes only after every rank's batch for it is complete, so no batch still
        generating is trained before it. The actor runs one call at a time: no other call's weights change."""
        root = self._call_root
        if root is None:
            return False
        latest = self._source(root).latest()
        if latest is not None and latest > int(self.engine.version):
            self._serve_disk_version(root, latest)
            self.switched_mid_call += 1
        return False

    def _source(self, root: str) -> DiskWeightSource:
        source = self.sources.get(root)
        if source is None:
            source = self.sources[root] = DiskWeightSource(root)
        return source

    def _serve_disk_version(self, root: str, version: int) -> None:
        """Load disk version ``version`` under ``root`` when it is newer than the served one (verified and applied
        all-or-nothing by the engine's `WeightReceiver`; the engine drops stale KV caches at its next call). An older
        one is not loaded back: the call runs under the newer weights (``served_newer`` counts such calls)."""
        served = int(self.engine.version)
        if version < served:
            self.served_newer += 1
            return
        if version == served:
            return
        source = self._source(root)
        manifest = source.manifest(version)  # a one-line WeightVersionError when it is not committed (or pruned)
        self.engine.receiver.apply(manifest, source.tensors(manifest))
        self.loaded.append(version)

    def receive_weights(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> int:
        """Receive one version from trainer rank 0's collective transport at ``host:port`` (joining its group
        first, or again after the sender changed); return the version now served."""
        from shardforge.weight_sync import CollectiveReceiver

        address = (host, port, rank, world_size)
        if self.receiver is None or self.address != address:
            self.receiver = CollectiveReceiver(self.engine.receiver, host, port, rank, world_size, timeout_s=timeout_s)
            self.address = address
        version = int(self.receiver.receive_version())  # the engine drops stale KV caches itself (weights_key)
        self.received.append(version)
        return version

    def stats(self) -> dict[str, Any]:
        """What this actor did: versions received (collective) and loaded (disk) in order, calls served under a newer
        version than they named, generate calls, rollouts per serving version."""
        return {
            "index": self.index,
            "version": int(self.engine.version),
            "received": list(self.received),
            "loaded": list(self.loaded),
            "served_newer": self.served_newer,
            "switched_mid_call": self.switched_mid_call,
            "generate_calls": self.generate_calls,
            "rollouts_by_version": dict(self.rollouts_by_version),
        }


class RayRolloutClient:
    """The trainer rank's `RolloutEngine` for ``rollout.placement=disaggregated`` (see the module docstring).

    Args:
        names: the rollout actors' Ray names (`rollout.placement.rollout_actor_names_from_env`).
        timeout_s: how long a weight transfer may wait for the other side (the collective transport's timeout).
        on_actor_failure: ``rollout.on_actor_failure``: ``error`` (a dead actor ends the run) or ``drop`` (the
            ranks drop it from the pool and regenerate the lost rounds on a live one; `rollout.actor_pool`).
        weights_root: asynchronous rollouts: the disk root the trainer publishes versions to; every call names the
            version this rank needs and the actor loads it (see the module docstring). None: versions arrive over
            the collective transport (`publish`), and every actor serves the newest.
    """

    accepts_images = False

    def __init__(
        self,
        names: Sequence[str],
        *,
        timeout_s: float = 300.0,
        on_actor_failure: str = "error",
        weights_root: str | os.PathLike[str] | None = None,
    ) -> None:
        import ray

        if not ray.is_initialized():
            raise ValueError("rollout.placement=disaggregated: this rank does not run inside a Ray actor")
        if on_actor_failure not in ("error", "drop"):
            raise ValueError(f"rollout.on_actor_failure={on_actor_failure!r} is not one of ['error', 'drop']")
        self.ray = ray
        self.names = list(names)
        self.actors = [ray.get_actor(name) for name in self.names]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.pool = ActorPool(self.names, rank=self.rank, world_size=world, drop=on_actor_failure == "drop")
        self.shared_restarts: ActorPool | None = self.pool if self.pool.drop else None
        """``drop``: the ranks' agreement once per generation round (`shardforge.rollout.server.shared_restart.generation_round`)."""
        self.timeout_s = timeout_s
        self.transport: Any = None
        self.transport_actors: list[int] = []
        """The actors (indices) the collective transport's group was built for."""
        self.host = ""
        self.weights_root = None if weights_root is None else str(Path(weights_root).resolve())
        """Asynchronous rollouts: the disk root every call names (absolute: the actors resolve it in their own
        working directory); None: the collective transport."""
        self.source = None if self.weights_root is None else DiskWeightSource(self.weights_root)
        self.publishes_directly = self.weights_root is None
        """The trainer calls `publish` (`rollout.publish.DirectPublisher`); False: it writes disk versions."""
        self._version = int(self._call(lambda actor: actor.ready.remote()))

    @property
    def version(self) -> int:
        return self._version

    @property
    def actor_index(self) -> int:
        """The actor this rank generates through (another one after its actor was dropped)."""
        return self.pool.current

    def _get(self, ref: Any, index: int) -> Any:
        """``ray.get(ref)``; a dead actor or a failed call becomes a one-line error naming the actor."""
        return ray_get(self.ray, ref, f"rollout actor {self.names[index]}", RuntimeError)

    def _call(self, method: Callable[[Any], Any]) -> Any:
        """``method(this rank's actor)`` (a ``.remote`` call) and its result; a dead actor goes to the pool
        (`ActorPool.actor_died`: an error, or the end of this rank's round)."""
        self.pool.raise_if_down()
        index = self.pool.current
        self.pool.calls += 1
        try:
            return self._get(method(self.actors[index]), index)
        except RolloutServerError as exc:
            self.pool.actor_died(index, exc)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        sessions: Sequence[Hashable | None] | None = None,
    ) -> list[Rollout]:
        """As `HFRolloutEngine.generate`, on this rank's actor; session keys are made unique per rank."""
        keys = None if sessions is None else [None if s is None else (self.rank, s) for s in sessions]
        batch = [list(p) for p in prompts]
        weights = None if self.weights_root is None else (self.weights_root, self._version)
        rollouts: list[Rollout] = self._call(lambda actor: actor.generate.remote(batch, params, keys, weights))
        return rollouts

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        keys = [(self.rank, s) for s in sessions]
        if keys:
            self._call(lambda actor: actor.end_sessions.remote(keys))

    def update_weights(self, version: int | None = None) -> int:
        """With ``weights_root``: the disk version (None: the newest committed) this rank's next calls need; no
        collective and no actor call (the actor loads it at the next call). Without: the actors serve what `publish`
        sent, and switching to another version is not possible."""
        if self.source is not None:
            target = self.source.latest() if version is None else version
            if target is None:
                raise WeightVersionError(f"no committed weight version under {self.source.root}")
            if target != 0:
                self.source.manifest(target)  # committed (a one-line error here, not in the actor)
            self._version = target
            return target
        if version is not None and version != self._version:
            raise RuntimeError(
                f"the rollout actors serve version {self._version}; version {version} was never published to them"
            )
        return self._version

    def pop_stats(self) -> dict[str, float]:
        """``rollout_actors/dropped|live|resent_requests`` since the last call (`ActorPool.pop_stats`)."""
        return self.pool.pop_stats()

    def publish(self, engine: Any, dtype: str, version: int | None) -> int:
        """Send ``engine``'s weights to every live rollout actor as ``version`` (None: the one after the served one)
        and return it once every one serves it. Collective over the trainer's ranks."""
        if self.source is not None:
            raise RuntimeError(
                f"this rollout client follows disk versions under {self.weights_root}: the trainer publishes them there "
                "(`rollout.publish.DiskPublisher`), not through `publish`"
            )
        version = self._version + 1 if version is None else version
        refs: list[tuple[int, Any]] = []
        if self.rank == 0:
            self._drop_dead_actors()
            refs = self._start_receiving(version)
        engine.publish_weights(self.transport, version, dtype=dtype, src_rank=0, checksums="crc32")
        if self.rank == 0:
            served = [self._get(ref, index) for index, ref in refs]
            if any(v != version for v in served):
                raise RuntimeError(f"published version {version}, but the rollout actors serve {served}")
        if dist.is_initialized():  # nobody samples before every actor serves the new version
            if self.pool.drop:  # rank 0's pool, with the actors it found dead before this publish dropped
                live = [self.pool.live]
                dist.broadcast_object_list(live, src=0)
                self.pool.set_live(live[0])
            else:
                dist.barrier()
        self._version = version
        return version

    def _drop_dead_actors(self) -> None:
        """Rank 0: ask every live actor whether it is alive (a dead one would keep the transport's group from
        forming until its timeout); drop the dead ones, or raise the one-line error (``error``)."""
        refs = [(index, self.actors[index].ready.remote()) for index in self.pool.live]
        dead: list[int] = []
        why = ""
        for index, ref in refs:
            try:
                self._get(ref, index)
            except RolloutServerError as exc:
                if not self.pool.drop:
                    self.pool.actor_died(index, exc)
                dead.append(index)
                why = why or f"{exc} (found by rank 0 before publishing a version)"
        if dead:
            self.pool.drop_actors(dead, why)

    def _start_receiving(self, version: int) -> list[tuple[int, Any]]:
        """Rank 0: the transport to the live actors (a new group when the pool changed) and their
        ``receive_weights`` calls, as (actor index, ref)."""
        from shardforge.weight_sync import CollectiveTransport

        live = list(self.pool.live)
        if self.transport is None or self.transport_actors != live:
            if self.transport is not None:  # an actor was dropped: the group of rank 0 + the live actors only
                self.transport.close()
            else:  # the actors may be on other nodes: listen on this node's address
                self.host = str(self.ray.util.get_node_ip_address())
            self.transport = CollectiveTransport(self.host, 0, len(live), timeout_s=self.timeout_s)
            self.transport_actors = live
        world = 1 + len(live)
        return [
            (index, self.actors[index].receive_weights.remote(self.host, self.transport.port, rank + 1, world,
                                                              self.timeout_s))
            for rank, index in enumerate(live)
        ]  # fmt: skip
