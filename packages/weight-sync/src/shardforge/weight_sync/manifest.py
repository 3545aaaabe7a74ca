"""The description of one published weight version, sent before/with its buckets."""

from __future__ import annotations

import ctypes
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["Manifest", "TensorInfo", "tensor_checksum"]


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes (CPU, contiguous). Needs no numpy."""
    flat = tensor.detach().to("cpu").contiguous()
    data = ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()) if flat.numel() else b""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    checksum: str


@dataclass
class Manifest:
    """Everything a receiver needs to verify a version before switching to it."""

    version: int
    tensors: list[TensorInfo] = field(default_factory=list)
    num_buckets: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data: dict[str, Any] = json.loads(text)
        tensors = [TensorInfo(**{**t, "shape": tuple(t["shape"])}) for t in data["tensors"]]
        return cls(version=int(data["version"]), tensors=tensors, num_buckets=int(data["num_buckets"]))

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]
