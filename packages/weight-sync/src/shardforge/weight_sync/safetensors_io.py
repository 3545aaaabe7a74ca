"""Write a safetensors file straight from tensor memory: header, then each tensor's bytes.

``safetensors.torch.save_file`` first copies every tensor into a Python ``bytes`` object;
for weight publishing that copy costs as much as the write itself. This writer hands the
tensors' own memory to ``os.write`` (zero copy for contiguous CPU tensors) and fsyncs.
The output is a standard safetensors file (read back with ``safetensors.torch.load_file``).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from pathlib import Path

import torch

__all__ = ["write_safetensors"]

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        written = os.write(fd, data)
        data = data[written:]


def write_safetensors(path: str | os.PathLike[str], names: list[str], tensors: list[torch.Tensor]) -> None:
    """Write ``names[i] -> tensors[i]`` to ``path`` as safetensors and fsync it."""
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in one safetensors file")
    contiguous = [t.detach().to("cpu").contiguous() for t in tensors]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in zip(names, contiguous):
        code = _CODES.get(tensor.dtype)
        if code is None:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be stored in safetensors; valid: {list(_CODES)}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    fd = os.open(Path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(encoded)) + encoded))
        for tensor in contiguous:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes:
                _write_all(fd, memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B"))
        os.fsync(fd)
    finally:
        os.close(fd)
