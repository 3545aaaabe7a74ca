"""shardforge.weight_sync: push trained weights from sharded trainers into inference engines.

Bucketed gathering (`WeightPublisher`, `iter_buckets`), the disk transport with atomic
version directories, the in-process transport (same-process receivers), the collective transport (a standalone gloo/NCCL group between the
sending rank and inference workers), a verifying `WeightReceiver`, and a vLLM adapter
(`shardforge.weight_sync.vllm`, optional extra ``[vllm]``; importing this package never
imports vLLM).
"""

from shardforge.weight_sync.buckets import Bucket, canonical_parameters, iter_buckets
from shardforge.weight_sync.collective import CollectiveReceiver, CollectiveTransport
from shardforge.weight_sync.disk import DiskTransport, DiskWeightSource, WeightVersionError
from shardforge.weight_sync.inprocess import InProcessTransport
from shardforge.weight_sync.manifest import Manifest, TensorInfo, tensor_checksum
from shardforge.weight_sync.publisher import PublishStats, WeightPublisher, WeightTransport
from shardforge.weight_sync.receiver import WeightReceiver

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "CollectiveReceiver",
    "CollectiveTransport",
    "DiskTransport",
    "DiskWeightSource",
    "InProcessTransport",
    "Manifest",
    "PublishStats",
    "TensorInfo",
    "WeightPublisher",
    "WeightReceiver",
    "WeightTransport",
    "WeightVersionError",
    "canonical_parameters",
    "iter_buckets",
    "tensor_checksum",
]
