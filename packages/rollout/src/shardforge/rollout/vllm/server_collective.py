"""Weights into a vLLM server over weight-sync's collective transport (``rollout.vllm.weight_transport: collective``).

No version is written to disk, so the server needs no filesystem in common with the trainer (the point of the Ray
server actor on another node). Trainer rank 0 owns a `CollectiveTransport` (a TCP store on ``host``, port picked
by the OS) and the server's workers join it through vLLM's ``/init_weight_transfer_engine`` with
``transport="collective"`` (weight-sync's ``shardforge`` backend, `shardforge.weight_sync.vllm_engine`): one gloo
group of rank 0 + ``rollout.vllm.tensor_parallel_size`` workers, built at the first send and again after every restart or
failed send. Each version (`CollectiveSender.send`, rank 0's part of `VLLMServerRolloutEngine.publish`):

1. ``/start_weight_update``, then ``/update_weights`` on a thread of its own: it returns only once the workers have
   received, verified (manifest, crc32) and loaded the version;
2. meanwhile ``TrainEngine.publish_weights(transport, version, src_rank=0)``, collective over the trainer's ranks:
   FSDP shards are gathered bucket by bucket and rank 0 broadcasts each bucket to the workers;
3. ``/finish_weight_update`` and ``/reset_prefix_cache`` (cached KV blocks hold the old weights' keys/values).

Two calls block until the other side arrives (the workers' group join and rank 0's; the workers' receive and rank
0's send), so one side of each runs on a thread. Nothing waits without a bound: the store, the group and every
broadcast time out after ``rollout.vllm.request_timeout_s`` (a dead server breaks the broadcast at once, a hung one after
the timeout), and rank 0 waits at most that long for each HTTP answer once its side is done. When rank 0 could not
prepare the transfer it still joins the gathers (into a transport that drops every bucket): the other ranks are
already in them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from shardforge.core.log import get_logger
from shardforge.rollout.config import VLLMOptions
from shardforge.rollout.server.health import RolloutServerError, down_message
from shardforge.rollout.server.http import ServerErrorReply, post_json
from shardforge.rollout.vllm.engine import require_main_thread
from shardforge.weight_sync import CollectiveTransport

__all__ = [
    "CHECKSUMS",
    "CollectivePublishing",
    "CollectiveSender",
    "TransferFailure",
    "WeightPublishingEngine",
    "publish_collectively",
]

log = get_logger(__name__)

CHECKSUMS = "crc32"
"""Per-tensor checksums in each version's manifest (the workers verify them before loading)."""
_SOCKET_TIMEOUT_S = 24 * 3600.0
"""The HTTP calls on threads answer only when the transfer ends: the caller bounds its wait, not the socket."""


class WeightPublishingEngine(Protocol):
    """What the server engine needs from the trainer's engine (`TrainEngine.publish_weights`)."""

    def publish_weights(
        self, transport: Any, version: int | None = None, *, dtype: Any = None, src_rank: int | None = 0,
        checksums: bool | str | None = CHECKSUMS,
    ) -> Any: ...  # fmt: skip


@dataclass(frozen=True)
class TransferFailure:
    """Why rank 0 could not switch the server to a version."""

    reason: str
    """One line: what failed and how."""
    server_failed: bool
    """The server died, hung or could not be reached (a restart may help); False: it answered with an error."""


class _Watched:
    """Rank 0's transport for one version. After its first error it drops everything and raises that error from
    `commit` only, which `WeightPublisher` calls once every bucket was gathered: rank 0 never leaves the other
    ranks' gathers (weight-sync's publisher raises a failed ``begin`` before the first gather), no broadcast to a
    dead server waits out the timeout twice, and a broken broadcast (the server failed) is told apart from a
    failure of the trainer's own gathers. ``transport=None``: drop every bucket (rank 0 joins the gathers of a
    transfer it could not start)."""

    def __init__(self, transport: CollectiveTransport | None) -> None:
        self.transport = transport
        self.error: BaseException | None = None

    def _call(self, method: str, *args: Any) -> None:
        if self.transport is None or self.error is not None:
            return
        try:
            getattr(self.transport, method)(*args)
        except Exception as exc:
            self.error = exc

    def begin(self, version: int) -> None:
        self._call("begin", version)

    def send(self, bucket: Any) -> None:
        self._call("send", bucket)

    def commit(self, manifest: Any) -> None:
        self._call("commit", manifest)
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        self._call("abort")


class _Background:
    """``fn(*args)`` on a daemon thread; `result` waits for it with a bound."""

    def __init__(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        self.what = what
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), name=f"vllm-weights: {what}", daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # reported by `result`
            self.error = exc

    def result(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"{self.what} did not end within {timeout_s:g} s (rollout.vllm.request_timeout_s)")
        if self.error is not None:
            raise self.error


class CollectiveSender:
    """Trainer rank 0's end of the collective transport into a vLLM server (see the module docstring).

    Args:
        host: the address the server's workers reach rank 0 at (loopback for a server this rank started; the
            node's IP under Ray, where the server may run on another node).
        num_workers: the server's vLLM workers (``rollout.vllm.tensor_parallel_size``).
        timeout_s: the bound on every wait (``rollout.vllm.request_timeout_s``).
    """

    def __init__(self, host: str, num_workers: int, timeout_s: float) -> None:
        self.host, self.num_workers, self.timeout_s = host, num_workers, timeout_s
        self.transport: CollectiveTransport | None = None
        self.groups_built = 0
        """Groups the workers joined so far (one, plus one per restart or failed send)."""

    def reset(self) -> None:
        """Forget the group (the server restarted, or a send failed): the next send builds a new one."""
        if self.transport is not None:
            self.transport.close()
        self.transport = None

    def _connect(self, url: str) -> CollectiveTransport:
        transport = CollectiveTransport(self.host, 0, self.num_workers, timeout_s=self.timeout_s)
        info = {
            "transport": "collective", "host": self.host, "port": transport.port, "world_size": 1 + self.num_workers,
            "rank_offset": 1, "timeout_s": self.timeout_s,
        }  # fmt: skip
        joined = _Background("rank 0 joining the weight group", transport.connect)
        init = _Background("/init_weight_transfer_engine", post_json, url, "/init_weight_transfer_engine",
                           {"init_info": info}, _SOCKET_TIMEOUT_S)  # fmt: skip
        try:
            init.result(self.timeout_s)  # answers once the workers are in the group (an error reply at once)
            joined.result(self.timeout_s)
        except BaseException:
            transport.close()
            raise
        self.transport = transport
        self.groups_built += 1
        return transport

    def send(self, url: str, engine: WeightPublishingEngine, dtype: str, version: int) -> TransferFailure | None:
        """Rank 0's part of one version (the other ranks call ``engine.publish_weights(None, ...)`` meanwhile);
        None once the server serves ``version``, else why not."""
        failure: TransferFailure | None = None
        transport = _Watched(None)
        update: _Background | None = None
        try:
            transport = _Watched(self.transport or self._connect(url))
            post_json(url, "/start_weight_update", {}, self.timeout_s)
            update = _Background("/update_weights", post_json, url, "/update_weights",
                                 {"update_info": {"version": version}}, _SOCKET_TIMEOUT_S)  # fmt: skip
        except Exception as exc:
            failure = _failure("preparing the transfer", exc)
            transport = _Watched(None)
        try:
            engine.publish_weights(transport, version, dtype=dtype, src_rank=0, checksums=CHECKSUMS)
        except Exception:
            if transport.error is None:  # the trainer's own failure, not the server's
                raise
            failure = TransferFailure(f"sending it failed: {_one_line(transport.error)}", server_failed=True)
        if failure is None and update is not None:
            try:
                update.result(self.timeout_s)  # the workers verified and loaded it
                post_json(url, "/finish_weight_update", {"weight_version": str(version)}, self.timeout_s)
                post_json(url, "/reset_prefix_cache", {}, self.timeout_s)
            except Exception as exc:
                failure = _failure("loading it", exc)
        if failure is not None:
            self.reset()  # the workers may be out of step with this group: the next send builds a new one
        return failure


def _failure(step: str, exc: BaseException) -> TransferFailure:
    # An HTTP error reply comes from a live server (it refused): a restart would not help. Anything else (refused
    # or reset connections, timeouts, a broken group) means the server did not answer.
    return TransferFailure(f"{step} failed: {_one_line(exc)}", server_failed=not isinstance(exc, ServerErrorReply))


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def publish_collectively(
    sender: CollectiveSender | None,
    url: str,
    engine: WeightPublishingEngine,
    dtype: str,
    version: int,
    on_failure: Callable[[TransferFailure], str | None],
) -> None:
    """Switch the server at ``url`` to ``engine``'s weights as ``version``; collective over all trainer ranks
    (rank 0 passes its ``sender``, the others None). ``on_failure`` (rank 0): what to do when the switch failed,
    returning the one-line error every rank raises, or None to go on (it stopped the server, which the next
    generation restarts at ``version``). Every rank returns only once rank 0 knows the outcome, so no rank samples
    from the previous version."""
    outcome: list[str | None] = [None]
    if sender is not None:
        failure = sender.send(url, engine, dtype, version)
        if failure is not None:
            outcome[0] = on_failure(failure)
    else:
        engine.publish_weights(None, version, dtype=dtype, src_rank=0, checksums=CHECKSUMS)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)  # every rank hears of a failure, or none waits for it
    if outcome[0] is not None:
        raise RolloutServerError(outcome[0])


class CollectivePublishing:
    """`VLLMServerRolloutEngine`'s part for ``rollout.vllm.weight_transport: collective``: `publish` (each version, and
    again after a restart) and `restore_weights`. Restart: the restarted server serves the model directory
    (version 0) and its new workers join a new group; the current version, which exists nowhere but in the
    trainer's shards, is gathered and sent again before anyone samples. Alone, rank 0 does it inside
    `restart_server`; ranks sharing the server agree on the restart at the end of a round (`shared_restart`), then
    all of them call `restore_weights`. The trainer's weights are still that version's: nothing updates them
    between a publish and the next round's end (asynchronous rollouts, which would, keep disk versions)."""

    publishes_directly: bool
    sender: CollectiveSender | None
    trainer: tuple[WeightPublishingEngine, str] | None
    url: str
    options: VLLMOptions
    command: list[str] | None
    log_path: Path | None
    _version: int

    def _stop_server(self) -> None:
        raise NotImplementedError  # the engine's

    def restore_weights(self) -> None:
        """Every rank, after a restart the ranks agreed on (`shared_restart`): resend the current version over the
        collective transport (the gathers need every rank). A no-op with disk versions (`restart_server` switched)."""
        if self.publishes_directly and self._version != 0:
            self._send(self._version)

    def publish(self, engine: WeightPublishingEngine, dtype: str, version: int | None = None) -> int:
        """Send ``engine``'s weights (cast to ``dtype``) to the server as ``version`` (None: the one after the served
        one) and return it once the server serves it; collective over all ranks (rollout.vllm.weight_transport=collective)."""
        if not self.publishes_directly:
            raise RuntimeError(
                "rollout.vllm.weight_transport=disk: publish versions to the weights root and update_weights"
            )
        version = self._version + 1 if version is None else version
        self.trainer = (engine, dtype)
        self._send(version)
        self._version = version
        return version

    def _send(self, version: int) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            require_main_thread("a shared vLLM server receives each version from every rank's shards at once")
        assert self.trainer is not None, "publish() sets the trainer's engine before any version is sent"
        engine, dtype = self.trainer
        publish_collectively(self.sender, self.url, engine, dtype, version, partial(self._transfer_failed, version))

    def _transfer_failed(self, version: int, failure: TransferFailure) -> str | None:
        """Rank 0: a version did not reach the server. Stop a failed server this trainer started when it may be
        restarted (None: the next generation restarts it at ``version``), else the one-line error."""
        what = f"weight version {version} over the collective transport: {failure.reason}"
        if not failure.server_failed:  # it answered with an error: a restart would not help
            return f"rollout server {self.url} refused {what}"
        if self.options.on_server_failure == "restart" and self.command is not None:
            log.warning(
                f"rollout server {self.url} failed to take {what}; stopped it (the next generation restarts it)"
            )
            self._stop_server()
            return None
        return down_message(
            self.url, what, launched=self.command is not None, log_path=self.log_path, restarts_left=None
        )
