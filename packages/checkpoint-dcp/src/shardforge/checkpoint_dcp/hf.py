"""Streaming HF safetensors export and import for sharded models.

Export gathers one parameter at a time (``DTensor.full_tensor()``, a collective every
rank joins) and rank 0 appends it to the current safetensors shard, writing the shard
when it reaches ``max_shard_bytes``: rank 0 never holds more than one shard beyond its
own parameters. Files are written into a temporary directory that is renamed into place
at the end, so a crash never leaves a half-written model directory behind.

Import reads one safetensors file at a time on rank 0 and scatters it into the sharded
model with `set_model_state_dict(..., broadcast_from_rank0=True)`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["export_hf", "load_hf", "write_hf_dir", "write_safetensors_shards"]

INDEX_FILE = "model.safetensors.index.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _canonical_keys(model: nn.Module) -> set[str]:
    """State-dict keys that own their storage (tied aliases such as lm_head.weight excluded)."""
    keys = {name for name, _ in model.named_parameters()}  # remove_duplicate=True drops aliases
    persistent = dict(model.named_buffers())
    for module_name, module in model.named_modules():
        for buffer_name in getattr(module, "_non_persistent_buffers_set", set()):
            persistent.pop(f"{module_name}.{buffer_name}" if module_name else buffer_name, None)
    return keys | set(persistent)


class _ShardWriter:
    """Accumulates tensors on rank 0 and writes numbered safetensors shards."""

    def __init__(self, directory: Path, max_shard_bytes: int) -> None:
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.max_shard_bytes:
            self.flush()
        self.current[name] = tensor.contiguous()
        self.current_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.current:
            return
        from safetensors.torch import save_file

        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.current, str(self.directory / name), metadata={"format": "pt"})
        self.files.append((name, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def finish(self) -> None:
        """Rename shards to HF's ``model-0000k-of-0000n`` names and write the index."""
        self.flush()
        count = len(self.files)
        if count == 1:
            os.replace(self.directory / self.files[0][0], self.directory / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for i, (name, keys) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.directory / name, self.directory / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))


def write_safetensors_shards(
    tensors: Any, out_dir: str | os.PathLike[str], *, max_shard_bytes: int = 2 * 1024**3
) -> None:
    """Write an iterable of (name, tensor) as HF-style sharded safetensors (single process)."""
    writer = _ShardWriter(Path(out_dir), max_shard_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.finish()


def write_hf_dir(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike[str],
    config: Any = None,
    tokenizer: Any = None,
    *,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
) -> None:
    """Write (name, CPU tensor) pairs as an HF model directory, atomically (single process).

    The directory is assembled next to ``out_dir`` and renamed into place at the end, so a crash
    leaves either the old export or the new one. ``config`` is saved with plain SDPA attention (and
    ``dtype`` when given); floating-point tensors are cast to ``dtype`` on the way.
    """
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    writer = _ShardWriter(tmp, max_shard_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor)
    writer.finish()
    if config is not None:
        hf_config = copy.deepcopy(config)
        hf_config._attn_implementation = "sdpa"
        if dtype is not None:
            hf_config.dtype = dtype
        hf_config.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def export_hf(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    config: Any = None,
    tokenizer: Any = None,
    *,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``model`` as an HF model directory loadable by ``from_pretrained``. Collective.

    Args:
        config: the HF config to save (default ``model.config``); its attention
            implementation is saved as plain SDPA.
        tokenizer: saved alongside when given.
        max_shard_bytes: size limit of one safetensors file.
        dtype: cast floating-point tensors (e.g. ``torch.bfloat16``) while exporting.
    """
    is_main = _rank() == 0
    keep = _canonical_keys(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))

    def full_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        # Every rank gathers every entry (full_tensor is collective); rank 0 yields them.
        for name, value in state.items():
            if name not in keep or not isinstance(value, torch.Tensor):
                continue
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if is_main:
                tensor = full.detach().to("cpu")
                yield name, tensor.clone() if tensor.data_ptr() == full.data_ptr() else tensor
            del full

    if is_main:
        config = config if config is not None else getattr(model, "config", None)
        write_hf_dir(full_tensors(), out_dir, config, tokenizer, max_shard_bytes=max_shard_bytes, dtype=dtype)
    else:
        for _ in full_tensors():
            pass
    _barrier()


def _files_and_keys(hf_dir: Path) -> list[tuple[Path, list[str]]]:
    index = hf_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for key, file in weight_map.items():
            by_file.setdefault(file, []).append(key)
        return [(hf_dir / f, keys) for f, keys in sorted(by_file.items())]
    single = hf_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return [(single, list(handle.keys()))]
    found = sorted(p.name for p in hf_dir.iterdir()) if hf_dir.is_dir() else "directory does not exist"
    raise FileNotFoundError(f"{hf_dir} has neither {INDEX_FILE} nor model.safetensors (found: {found})")


def load_hf(model: nn.Module, hf_dir: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Stream HF safetensors weights into a materialised (possibly sharded) ``model``. Collective.

    Rank 0 reads one file at a time; every rank receives only its shards. With ``strict``,
    keys the model has but the files lack (other than tied aliases), or keys the files
    have but the model lacks, raise `ValueError` before any weight is loaded.
    """
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "load_hf needs materialised parameters; call model.to_empty(device=...) after sharding "
            "(and restore non-persistent buffers) before loading"
        )
    path = Path(hf_dir)
    plan = _files_and_keys(path)
    if strict:
        want = _canonical_keys(model)
        have = {k for _, keys in plan for k in keys}
        missing, unexpected = sorted(want - have), sorted(have - set(get_model_state_dict(model)))
        if missing or unexpected:
            raise ValueError(
                f"{path} does not match {type(model).__name__}: missing {missing[:20]} "
                f"({len(missing)}), unexpected {unexpected[:20]} ({len(unexpected)})"
            )
    from safetensors import safe_open

    for file, keys in plan:
        part: dict[str, Any] = {}
        if _rank() == 0:
            with safe_open(str(file), framework="pt") as handle:
                part = {k: handle.get_tensor(k) for k in keys}
        if dist.is_initialized():
            set_model_state_dict(
                model, part, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
            )
        else:
            model.load_state_dict(part, strict=False)
        del part
    _barrier()
