"""The description of one published weight version, sent before/with its buckets."""

from __future__ import annotations

import ctypes
import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["CHECKSUM_ALGORITHMS", "Manifest", "TensorInfo", "checksum_matches", "tensor_checksum"]


CHECKSUM_ALGORITHMS = ("crc32", "sha256")
"""crc32 (default, ~3 GB/s per core) catches transfer and disk corruption; sha256 (~0.75 GB/s)
when a cryptographic digest is wanted."""


def _raw_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(keep-alive tensor, zero-copy buffer) over the tensor's bytes in logical order."""
    flat = tensor.detach().to("cpu").contiguous()
    nbytes = flat.numel() * flat.element_size()
    return flat, (ctypes.c_char * nbytes).from_address(flat.data_ptr()) if nbytes else b""


def tensor_checksum(tensor: torch.Tensor, algorithm: str = "crc32") -> str:
    """``"<algorithm>:<hex digest>"`` of the tensor's bytes (layout-independent; no numpy, no copy
    of contiguous CPU tensors; hashing releases the GIL so it overlaps with other work)."""
    keep, data = _raw_bytes(tensor)
    if algorithm == "crc32":
        digest = f"{zlib.crc32(data):08x}"  # type: ignore[arg-type]
    elif algorithm == "sha256":
        digest = hashlib.sha256(data).hexdigest()  # type: ignore[arg-type]
    else:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; valid: {CHECKSUM_ALGORITHMS}")
    del keep
    return f"{algorithm}:{digest}"


def checksum_matches(tensor: torch.Tensor, checksum: str) -> bool:
    """Whether ``tensor`` has ``checksum`` (any algorithm `tensor_checksum` writes; a bare hex
    digest is read as sha256)."""
    algorithm, sep, _ = checksum.partition(":")
    if not sep:
        checksum, algorithm = f"sha256:{checksum}", "sha256"
    return tensor_checksum(tensor, algorithm) == checksum


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
