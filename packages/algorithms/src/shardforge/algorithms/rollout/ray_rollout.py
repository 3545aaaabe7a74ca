"""Disaggregated rollouts under Ray: the embedded HF engine in an actor of its own, and the trainer's client.

- `RolloutActor` (started by `shardforge.algorithms.ray_launch`, one per ``num_rollout_actors``) wraps an
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

Sampling is seeded per request (`rollout.seeds`), so the actor samples what the colocated engine would.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch.distributed as dist

from shardforge.algorithms.log import get_logger
from shardforge.algorithms.rollout.placement import actor_for_rank
from shardforge.algorithms.rollout.server_health import ray_get
from shardforge.algorithms.rollout.types import Rollout, SamplingParams
from shardforge.weight_sync import DiskWeightSource

__all__ = ["RayRolloutClient", "RolloutActor"]

log = get_logger(__name__)


class RolloutActor:
    """One rollout engine as a Ray actor (the class is wrapped with ``ray.remote`` by the launcher)."""

    def __init__(self, spec: Any, index: int) -> None:
        import torch
        from transformers import AutoTokenizer

        from shardforge.algorithms.rollout.hf_engine import HFRolloutEngine
        from shardforge.algorithms.rollout.kv_reuse import KVReuseCache
        from shardforge.mesh import current_device

        torch.set_num_threads(1)  # one bundle = one CPU; the ranks' generate ran single-threaded too
        self.index = index
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer)
        self.engine = HFRolloutEngine(spec.model, tokenizer, dtype=spec.dtype, device=current_device())
        self.engine.kv_reuse = spec.kv_reuse
        self.engine.kv_cache = KVReuseCache(spec.kv_reuse_max_tokens)
        self.receiver: Any = None
        self.address: tuple[str, int, int, int] | None = None
        self.received: list[int] = []
        self.generate_calls = 0
        self.rollouts_by_version: dict[int, int] = {}

    def ready(self) -> int:
        """The version served (0: the model directory's weights); returns once the engine is built."""
        return int(self.engine.version)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, sessions: list[Hashable | None] | None = None
    ) -> list[Rollout]:
        rollouts = self.engine.generate(prompts, params, sessions=sessions)
        self.generate_calls += 1
        version = int(self.engine.version)
        self.rollouts_by_version[version] = self.rollouts_by_version.get(version, 0) + len(rollouts)
        return rollouts

    def end_sessions(self, sessions: list[Hashable]) -> None:
        self.engine.end_sessions(sessions)

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
        """What this actor did: versions received in order, generate calls, rollouts per serving version."""
        return {
            "index": self.index,
            "version": int(self.engine.version),
            "received": list(self.received),
            "generate_calls": self.generate_calls,
            "rollouts_by_version": dict(self.rollouts_by_version),
        }


class RayRolloutClient:
    """The trainer rank's `RolloutEngine` for ``rollout_placement=disaggregated`` (see the module docstring).

    Args:
        names: the rollout actors' Ray names (`rollout.placement.rollout_actor_names_from_env`).
        timeout_s: how long a weight transfer may wait for the other side (the collective transport's timeout).
    """

    source: DiskWeightSource | None = None  # no disk root: versions arrive over the collective transport
    accepts_images = False

    def __init__(self, names: Sequence[str], *, timeout_s: float = 300.0) -> None:
        import ray

        if not ray.is_initialized():
            raise ValueError("rollout_placement=disaggregated: this rank does not run inside a Ray actor")
        self.ray = ray
        self.names = list(names)
        self.actors = [ray.get_actor(name) for name in self.names]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.actor_index = actor_for_rank(self.rank, len(self.actors))
        self.actor = self.actors[self.actor_index]
        self.timeout_s = timeout_s
        self.transport: Any = None
        self.host = ""
        self._version = int(self._get(self.actor.ready.remote(), self.actor_index))

    @property
    def version(self) -> int:
        return self._version

    def _get(self, ref: Any, index: int) -> Any:
        """``ray.get(ref)``; a dead actor or a failed call becomes a one-line error naming the actor."""
        return ray_get(self.ray, ref, f"rollout actor {self.names[index]}", RuntimeError)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        sessions: Sequence[Hashable | None] | None = None,
    ) -> list[Rollout]:
        """As `HFRolloutEngine.generate`, on this rank's actor; session keys are made unique per rank."""
        keys = None if sessions is None else [None if s is None else (self.rank, s) for s in sessions]
        rollouts: list[Rollout] = self._get(
            self.actor.generate.remote([list(p) for p in prompts], params, keys), self.actor_index
        )
        return rollouts

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        keys = [(self.rank, s) for s in sessions]
        if keys:
            self._get(self.actor.end_sessions.remote(keys), self.actor_index)

    def update_weights(self, version: int | None = None) -> int:
        """The actors serve what `publish` sent; switching to another version is not possible."""
        if version is not None and version != self._version:
            raise RuntimeError(
                f"the rollout actors serve version {self._version}; version {version} was never published to them"
            )
        return self._version

    def publish(self, engine: Any, dtype: str, version: int | None) -> int:
        """Send ``engine``'s weights to every rollout actor as ``version`` (None: the one after the served one)
        and return it once every actor serves it. Collective over the trainer's ranks."""
        version = self._version + 1 if version is None else version
        refs: list[Any] = []
        if self.rank == 0:
            from shardforge.weight_sync import CollectiveTransport

            if self.transport is None:  # the actors may be on other nodes: listen on this node's address
                self.host = str(self.ray.util.get_node_ip_address())
                self.transport = CollectiveTransport(self.host, 0, len(self.actors), timeout_s=self.timeout_s)
            world = 1 + len(self.actors)
            refs = [
                actor.receive_weights.remote(self.host, self.transport.port, index + 1, world, self.timeout_s)
                for index, actor in enumerate(self.actors)
            ]
        engine.publish_weights(self.transport, version, dtype=dtype, src_rank=0, checksums="crc32")
        if self.rank == 0:
            served = [self._get(ref, index) for index, ref in enumerate(refs)]
            if any(v != version for v in served):
                raise RuntimeError(f"published version {version}, but the rollout actors serve {served}")
        if dist.is_initialized():
            dist.barrier()  # nobody samples before every actor serves the new version
        self._version = version
        return version
