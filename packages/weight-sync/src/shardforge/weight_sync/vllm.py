"""Push a trainer's weights into a running vLLM engine (the ``[vllm]`` extra).

Trainer side of the adapter; the worker side is `shardforge.weight_sync.vllm_engine`,
which vLLM loads through our ``vllm.general_plugins`` entry point. Start vLLM with
``weight_transfer_config={"backend": "shardforge"}``, then on every trainer rank::

    sync = connect_vllm(model, LLMClient(llm), port=29700, dtype=torch.bfloat16)
    sync.publish(version=step)  # collective over the trainer ranks

`VLLMWeightSync` is a vLLM `TrainerWeightTransferEngine` registered under the same
backend name, so ``WeightTransferTrainerFactory.trainer_init(ShardforgeTrainerInitInfo(...),
client=..., source=ModelSource(model))`` builds the same object. It drives vLLM's
weight-sync control plane (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``) through any `VLLMWeightSyncClient`: the
in-process `LLMClient` below, vLLM's ``HTTPVLLMWeightSyncClient`` for a server started with
``VLLM_SERVER_DEV_MODE=1``, or its Ray client. The data moves through our
`WeightPublisher` (bucketed gather, HF names, dtype cast, manifest with checksums) over a
`CollectiveTransport` (gloo, no shared filesystem) or a `DiskTransport`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from shardforge.weight_sync.buckets import canonical_parameters
from shardforge.weight_sync.collective import CollectiveTransport
from shardforge.weight_sync.disk import DiskTransport, WeightVersionError
from shardforge.weight_sync.publisher import PublishStats, WeightPublisher, WeightTransport
from shardforge.weight_sync.vllm_engine import (
    BACKEND,
    TRANSPORTS,
    ShardforgeInitInfo,
    ShardforgeUpdateInfo,
    ShardforgeWeightTransferEngine,
    register,
)

__all__ = [
    "BACKEND",
    "LLMClient",
    "ModelSource",
    "ShardforgeTrainerInitInfo",
    "ShardforgeWeightTransferEngine",
    "VLLMWeightSync",
    "connect_vllm",
    "register",
]


class LLMClient:
    """`VLLMWeightSyncClient` for an in-process ``vllm.LLM`` (vLLM ships HTTP and Ray clients only)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        # Prompt KV blocks in the prefix cache were computed with the old weights: drop them, or a
        # later request that shares a full block with an earlier one reuses stale keys/values.
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


class ModelSource(WeightSource):
    """vLLM's `WeightSource` view of a (sharded) ``nn.Module``, in our publishing order.

    `VLLMWeightSync` publishes ``module`` with `WeightPublisher`; ``metadata()`` and
    iteration exist for vLLM's interface (iteration gathers every DTensor: a collective).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype | None = None) -> None:
        self.module = module
        self.dtype = dtype

    def _cast(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, self._cast(t.dtype), tuple(t.shape)) for n, t in canonical_parameters(self.module)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in canonical_parameters(self.module):
            full = value.detach()
            if isinstance(full, DTensor):
                full = full.full_tensor()
            yield name, full.to(self._cast(full.dtype))


@dataclass
class ShardforgeTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings (vLLM's ``TrainerInitInfo``; ``rank`` is keyword-only and required).

    ``rank`` is this process's rank in the trainer's default process group (0 without
    one); trainer rank 0 sends, every rank joins the gathers.
    """

    backend: ClassVar[str] = BACKEND

    transport: str = "collective"
    """``"collective"`` (gloo group between trainer rank 0 and the vLLM workers) or ``"disk"``."""
    host: str = "127.0.0.1"
    """collective: the address trainer rank 0 listens on (the vLLM workers connect to it)."""
    port: int = 0
    """collective: a free TCP port on ``host``."""
    num_workers: int = 1
    """collective: vLLM workers in total (tensor x pipeline x data parallel)."""
    root: str = ""
    """disk: a directory both the trainer and vLLM can read and write."""
    bucket_bytes: int = 256 * 1024**2
    """`WeightPublisher` bucket size (host memory on rank 0: at most two buckets)."""
    dtype: str | None = None
    """Cast floating-point tensors to this torch dtype name (e.g. ``"bfloat16"``): publish in vLLM's dtype."""
    timeout_s: float = 300.0
    """collective: a stalled rendezvous or transfer fails after this many seconds."""
    checksums: bool = True
    """Record sha256 per tensor; the workers verify them before loading."""

    def torch_dtype(self) -> torch.dtype | None:
        if self.dtype is None:
            return None
        value = getattr(torch, self.dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"dtype={self.dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
        return value

    def worker_init_info(self) -> ShardforgeInitInfo:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {TRANSPORTS}")
        if self.transport == "disk":
            return ShardforgeInitInfo(transport="disk", root=self.root, verify_checksums=self.checksums)
        if self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers} must be >= 1")
        return ShardforgeInitInfo(
            transport="collective",
            host=self.host,
            port=self.port,
            world_size=1 + self.num_workers,
            timeout_s=self.timeout_s,
            verify_checksums=self.checksums,
        )


class VLLMWeightSync(TrainerWeightTransferEngine[ShardforgeTrainerInitInfo]):
    """Publishes numbered versions of a model into a vLLM engine. Build with `connect_vllm`."""

    init_info_cls = ShardforgeTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: ModelSource, init_info: ShardforgeTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.model = source.module
        self.version = 0
        """The last version published (0: none yet)."""
        self.publisher: WeightPublisher | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: ShardforgeTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Connect to the vLLM workers (every trainer rank calls this; rank 0 does the handshake)."""
        if not isinstance(source, ModelSource):
            raise TypeError(
                f"the {BACKEND!r} backend publishes a module: pass source=ModelSource(model), got {type(source).__name__}"
            )
        global_rank = dist.get_rank() if dist.is_initialized() else 0
        if init_info.rank != global_rank:
            raise ValueError(f"init_info.rank={init_info.rank} must be this process's trainer rank {global_rank}")
        engine = cls(client=client, source=source, init_info=init_info)
        transport: WeightTransport | None = None
        if engine.is_sender:
            transport = engine._open_transport()
        engine.publisher = WeightPublisher(
            engine.model,
            transport,
            bucket_bytes=init_info.bucket_bytes,
            dtype=init_info.torch_dtype(),
            src_rank=0,
            checksums=init_info.checksums,
        )
        return engine

    def _open_transport(self) -> WeightTransport:
        info = self.init_info
        worker_info = asdict(info.worker_init_info())
        if info.transport == "disk":
            self.client.init_weight_transfer_engine(worker_info)
            return DiskTransport(info.root)
        # The workers block in init_weight_transfer_engine until the gloo group is
        # complete, and so does our side: run the RPC beside the rendezvous.
        errors: list[BaseException] = []

        def init_workers() -> None:
            try:
                self.client.init_weight_transfer_engine(worker_info)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=init_workers, name="vllm-weight-sync-init", daemon=True)
        thread.start()
        transport = CollectiveTransport(info.host, info.port, info.num_workers, timeout_s=info.timeout_s)
        transport.connect()  # the group forms once every worker has joined
        thread.join(info.timeout_s)
        if errors or thread.is_alive():
            raise RuntimeError("vLLM workers failed to join the weight-sync group") from (errors[0] if errors else None)
        return transport

    def publish(self, version: int) -> PublishStats | None:
        """Publish ``version`` and switch vLLM to it (collective over the trainer ranks).

        Returns `PublishStats` on rank 0 (``seconds``: gather + transfer, not the RPCs
        around them), None elsewhere. Raises if vLLM did not switch; it then keeps
        serving the previous version.
        """
        publisher = self.publisher
        assert publisher is not None, "build with connect_vllm / trainer_init"
        if version <= self.version:
            raise WeightVersionError(f"version {version} is not newer than the published version {self.version}")
        if not self.is_sender:
            publisher.publish(version)
            self.version = version
            return None
        update = asdict(ShardforgeUpdateInfo(version=version))
        self.client.start_weight_update()
        if self.init_info.transport == "disk":
            stats = publisher.publish(version)  # committed atomically before vLLM reads it
            self.client.update_weights(update)
        else:
            stats = self._publish_collective(publisher, version, update)
        self.client.finish_weight_update(str(version))
        self.version = version
        return stats

    def _publish_collective(
        self, publisher: WeightPublisher, version: int, update: dict[str, Any]
    ) -> PublishStats | None:
        # update_weights returns only once the workers received and loaded the whole
        # version, so it runs beside the broadcast (as vLLM's NCCL engine does).
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                self.client.update_weights(update)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=receive, name="vllm-weight-sync-update", daemon=True)
        thread.start()
        try:
            stats = publisher.publish(version)
        finally:
            # After a failed send the transport broadcast ABORT, so the workers return
            # (with an error) too; the timeout only guards against a vanished peer.
            thread.join(self.init_info.timeout_s)
        if errors or thread.is_alive():
            cause = errors[0] if errors else TimeoutError(f"no answer from vLLM in {self.init_info.timeout_s}s")
            raise RuntimeError(f"vLLM did not switch to version {version}; it serves the previous one") from cause
        return stats

    def send_weights(self) -> None:
        """vLLM's trainer-engine entry point: publish the next version number."""
        self.publish(self.version + 1)

    def shutdown(self) -> None:
        """Release the workers' side of the connection (vLLM keeps serving)."""
        close = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if self.is_sender and callable(close):
            close()
        self.publisher = None


def connect_vllm(
    model: nn.Module,
    client: VLLMWeightSyncClient | None,
    *,
    transport: str = "collective",
    host: str = "127.0.0.1",
    port: int = 0,
    num_workers: int = 1,
    root: str = "",
    bucket_bytes: int = 256 * 1024**2,
    dtype: torch.dtype | None = None,
    timeout_s: float = 300.0,
    checksums: bool = True,
) -> VLLMWeightSync:
    """Connect ``model`` (plain, FSDP 2 or DTensor-sharded) to a vLLM engine; call on every trainer rank.

    ``client`` is used on trainer rank 0 only (others may pass None). See
    `ShardforgeTrainerInitInfo` for the other arguments.
    """
    register()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and client is None:
        raise ValueError("trainer rank 0 talks to vLLM and needs a client (LLMClient(llm) or an HTTP client)")
    info = ShardforgeTrainerInitInfo(
        rank=rank,
        transport=transport,
        host=host,
        port=port,
        num_workers=num_workers,
        root=root,
        bucket_bytes=bucket_bytes,
        dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        timeout_s=timeout_s,
        checksums=checksums,
    )
    return VLLMWeightSync.trainer_init(info, client=client or _NoClient(), source=ModelSource(model, dtype))


class _NoClient:
    """Placeholder on trainer ranks > 0, which never talk to vLLM."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("only trainer rank 0 talks to vLLM")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _refuse
