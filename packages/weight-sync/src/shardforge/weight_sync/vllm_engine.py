"""vLLM worker side: the ``"shardforge"`` weight-transfer engine.

vLLM (0.32) creates one `WeightTransferEngine` per worker, picked by
``WeightTransferConfig(backend=...)`` from `WeightTransferEngineFactory`. None of the
built-in engines runs on CPU (they use NCCL, CUDA IPC or RDMA, and the base class
synchronizes a CUDA-like accelerator after every update), so this module registers our
own engine under the name ``"shardforge"``. `register` runs in every vLLM process through
the ``vllm.general_plugins`` entry point this package declares, so installing the extra
is enough; nothing in vLLM is patched.

The engine receives a whole version from a `WeightPublisher` over one of our transports:

- ``collective``: the worker joins the sender's `CollectiveTransport` group (gloo) with a
  `CollectiveReceiver`; each ``update_weights`` call receives one version.
- ``disk``: ``update_weights`` reads a committed version from a `DiskTransport` root.

Either way the tensors are staged in host memory and checked against the version's
manifest (every name present, shapes, dtypes, sha256) before the first one is loaded; only
then are they loaded into the vLLM model with its own ``load_weights`` (which maps HF names
onto vLLM's fused parameters) inside vLLM's layerwise-reload lifecycle. All of this
happens inside one ``update_weights`` RPC, during which the engine core runs no forward
pass, so no request ever sees a half-loaded version. A failed or partial transfer raises
from ``update_weights`` and leaves the previous version serving.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from shardforge.weight_sync.collective import CollectiveReceiver
from shardforge.weight_sync.disk import DiskWeightSource, WeightVersionError
from shardforge.weight_sync.manifest import Manifest, tensor_checksum
from shardforge.weight_sync.receiver import WeightReceiver

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = [
    "BACKEND",
    "TRANSPORTS",
    "ShardforgeInitInfo",
    "ShardforgeUpdateInfo",
    "ShardforgeWeightTransferEngine",
    "register",
    "verify_version",
]

BACKEND = "shardforge"
"""The name of our engine in vLLM's registries (``WeightTransferConfig(backend=BACKEND)``)."""
TRANSPORTS = ("collective", "disk")

logger = logging.getLogger(__name__)


@dataclass
class ShardforgeInitInfo(WeightTransferInitInfo):
    """What a worker needs to reach the trainer (sent once, by ``init_weight_transfer_engine``)."""

    transport: str
    """``"collective"`` (gloo group with the sending rank) or ``"disk"`` (shared directory)."""
    host: str = ""
    """collective: address of the sender's TCPStore."""
    port: int = 0
    """collective: port of the sender's TCPStore."""
    world_size: int = 0
    """collective: 1 (the sender) + the number of vLLM workers."""
    rank_offset: int = 1
    """collective: the weight-group rank of vLLM worker 0 (the sender is rank 0)."""
    timeout_s: float = 300.0
    """collective: a stalled transfer fails after this many seconds."""
    root: str = ""
    """disk: the `DiskTransport` root the trainer publishes into."""
    verify_checksums: bool = True
    """Check every tensor against the manifest's sha256 before loading."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {TRANSPORTS}")
        if self.transport == "collective" and (not self.host or self.port <= 0 or self.world_size < 2):
            raise ValueError(
                f"the collective transport needs host, port > 0 and world_size >= 2 "
                f"(got host={self.host!r}, port={self.port}, world_size={self.world_size})"
            )
        if self.transport == "disk" and not self.root:
            raise ValueError("the disk transport needs root= (the DiskTransport directory)")


@dataclass
class ShardforgeUpdateInfo(WeightTransferUpdateInfo):
    """One ``update_weights`` call: the version the trainer is publishing."""

    version: int


def verify_version(
    manifest: Manifest,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    current: int,
    verify_checksums: bool = True,
) -> list[tuple[str, torch.Tensor]]:
    """Stage a whole version and check it against its manifest; raise `WeightVersionError`.

    The same checks as `WeightReceiver.apply` except the ones against the model's own
    ``state_dict`` (a vLLM model fuses HF parameters, so its names differ; its
    ``load_weights`` does that mapping and rejects unknown names itself).
    """
    if manifest.version <= current:
        kind = "duplicate" if manifest.version == current else "stale"
        raise WeightVersionError(f"{kind} version {manifest.version}: this engine already serves version {current}")
    expected = {t.name: t for t in manifest.tensors}
    staged: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        info = expected.get(name)
        if info is None:
            raise WeightVersionError(f"version {manifest.version}: unexpected tensor {name}")
        if tuple(tensor.shape) != tuple(info.shape) or str(tensor.dtype) != info.dtype:
            raise WeightVersionError(
                f"version {manifest.version}: {name} arrived as {tuple(tensor.shape)} {tensor.dtype}, "
                f"manifest says {info.shape} {info.dtype}"
            )
        if verify_checksums and info.checksum and tensor_checksum(tensor) != info.checksum:
            raise WeightVersionError(f"version {manifest.version}: checksum mismatch for {name}")
        staged[name] = tensor
    missing = sorted(set(expected) - set(staged))
    if missing:
        raise WeightVersionError(f"version {manifest.version} is incomplete: missing {missing[:10]} ({len(missing)})")
    return list(staged.items())


class _VLLMModelReceiver(WeightReceiver):
    """A `WeightReceiver` whose switch is "verify, then load into the vLLM model"."""

    def __init__(self, engine: ShardforgeWeightTransferEngine) -> None:
        super().__init__(engine.model, version=engine.version, verify_checksums=engine.verify_checksums)
        self.engine = engine

    def apply(self, manifest: Manifest, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.version = self.engine.version
        staged = verify_version(manifest, tensors, current=self.version, verify_checksums=self.verify_checksums)
        with self.lock:
            self.engine.load_version(manifest.version, staged)
            self.version = manifest.version


class ShardforgeWeightTransferEngine(WeightTransferEngine[ShardforgeInitInfo, ShardforgeUpdateInfo]):
    """Receives versions published by `WeightPublisher` and loads them into a vLLM worker's model."""

    init_info_cls = ShardforgeInitInfo
    update_info_cls = ShardforgeUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.version = 0
        """The version this worker serves (0: the weights vLLM loaded at start-up)."""
        self.verify_checksums = True
        self._collective: CollectiveReceiver | None = None
        self._disk: DiskWeightSource | None = None

    def worker_rank(self) -> int:
        """This worker's rank among all workers of all data-parallel replicas."""
        parallel = self.parallel_config
        return int(parallel.data_parallel_index * parallel.world_size + parallel.rank)

    def init_transfer_engine(self, init_info: ShardforgeInitInfo) -> None:
        self.shutdown()
        self.verify_checksums = init_info.verify_checksums
        if init_info.transport == "disk":
            self._disk = DiskWeightSource(init_info.root)
            return
        rank = init_info.rank_offset + self.worker_rank()
        receiver = CollectiveReceiver(
            _VLLMModelReceiver(self),
            init_info.host,
            init_info.port,
            rank,
            init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        receiver.connect()  # blocks until the sender's group is complete
        self._collective = receiver

    def start_weight_update(self) -> None:
        """Nothing to prepare: a version is staged and loaded within one ``update_weights``."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a
        # CPU-only host; loading here is synchronous, so only sync where there is one.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShardforgeUpdateInfo) -> None:
        if self._collective is not None:
            self._collective.receive_version()
            if self.version != update_info.version:
                raise WeightVersionError(
                    f"the trainer announced version {update_info.version} but sent version {self.version}"
                )
            return
        if self._disk is None:
            raise RuntimeError("the shardforge weight transfer is not initialized: call init_weight_transfer_engine")
        manifest = self._disk.manifest(update_info.version)
        staged = verify_version(
            manifest, self._disk.tensors(manifest), current=self.version, verify_checksums=self.verify_checksums
        )
        self.load_version(manifest.version, staged)

    def load_version(self, version: int, staged: list[tuple[str, torch.Tensor]]) -> None:
        """Load a verified version into the model (vLLM's layerwise-reload lifecycle)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        load_weights = getattr(self.model, "load_weights", None)
        if not callable(load_weights):
            raise TypeError(f"{type(self.model).__name__} has no load_weights(); vLLM models all do")
        tied = _tied_layers(self.model)
        initialize_layerwise_reload(self.model)
        load_weights((name, tensor.to(self.device)) for name, tensor in staged)
        finalize_layerwise_reload(self.model, self.model_config)
        # A layer that shares its weight with another (tied lm_head / embed_tokens) gets
        # no tensor of its own, so the layerwise reload does not re-run its
        # post-processing; on CPU that leaves lm_head's prepacked GEMM weight stale.
        sent = {name for name, _ in staged}
        for prefix, layer in tied:
            method = getattr(layer, "quant_method", None)
            own = [f"{prefix}.{p}" for p, _ in layer.named_parameters(recurse=False)]
            if method is not None and not any(name in sent for name in own):
                method.process_weights_after_loading(layer)
        self.version = version
        logger.info("shardforge weight sync: now serving version %d (%d tensors)", version, len(staged))

    def finish_weight_update(self) -> None:
        """Nothing left to do: ``update_weights`` switched to the version it received."""

    def shutdown(self) -> None:
        self._collective = None
        self._disk = None


def _tied_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Layers whose own parameters share storage with another layer's (weight tying)."""
    by_storage: dict[int, list[tuple[str, nn.Module]]] = {}
    for prefix, layer in model.named_modules():
        for _, param in layer.named_parameters(recurse=False):
            if param.device.type != "meta":
                by_storage.setdefault(param.untyped_storage().data_ptr(), []).append((prefix, layer))
    return [entry for group in by_storage.values() if len(group) > 1 for entry in group]


def register() -> None:
    """Register the ``"shardforge"`` engines with vLLM (idempotent; the plugin entry point).

    The worker engine is this module's; the trainer engine (`VLLMWeightSync`) is
    registered lazily, so vLLM's workers never import the trainer side.
    """
    registrations: list[tuple[Any, Any, str | None]] = [
        (WeightTransferEngineFactory, ShardforgeWeightTransferEngine, None),
        (WeightTransferTrainerFactory, "shardforge.weight_sync.vllm", "VLLMWeightSync"),
    ]
    for factory, target, class_name in registrations:
        try:
            factory.register_engine(BACKEND, target, class_name)
        except ValueError:  # already registered (plugins may run more than once per process)
            pass
