"""Offline DCP -> HF safetensors conversion, in one process and without a process group.

    python -m shardforge.checkpoint_dcp.convert CHECKPOINT_DIR OUT_DIR --config HF_MODEL_DIR

Reads the model tensors of a committed checkpoint group by group (each group at most
``--max-shard-bytes``), writes them as HF safetensors shards, and copies the HF config
(and tokenizer files) from ``--config``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardforge.checkpoint_dcp.checkpointer import COMMIT_MARKER
from shardforge.checkpoint_dcp.hf import INDEX_FILE, _ShardWriter

__all__ = ["convert_dcp_to_hf", "main"]

_HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def convert_dcp_to_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    config_dir: str | Path | None = None,
    prefix: str = "train.model.",
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
    skip_keys: tuple[str, ...] = (),
) -> list[str]:
    """Convert; return the exported parameter names."""
    source = Path(checkpoint_dir)
    if not (source / ".metadata").is_file():
        raise FileNotFoundError(f"{source} is not a DCP checkpoint (no .metadata)")
    if not (source / COMMIT_MARKER).is_file():
        raise ValueError(f"{source} has no {COMMIT_MARKER} marker: it is an incomplete save and must not be used")
    reader = dcp.FileSystemReader(str(source))
    metadata = reader.read_metadata()
    entries = [
        (key, meta)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata) and key[len(prefix) :] not in skip_keys
    ]
    if not entries:
        prefixes = sorted({k.split(".")[0] for k in metadata.state_dict_metadata})
        raise ValueError(f"no tensors under {prefix!r} in {source}; top-level keys: {prefixes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, max_shard_bytes)
    group: dict[str, torch.Tensor] = {}
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if not group:
            return
        dcp.load(group, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        for key, tensor in group.items():
            writer.add(
                key[len(prefix) :], tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            )
        group, group_bytes = {}, 0

    for key, meta in entries:
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        size = tensor.numel() * tensor.element_size()
        if group and group_bytes + size > max_shard_bytes:
            flush()
        group[key] = tensor
        group_bytes += size
    flush()
    writer.finish()
    if config_dir is not None:
        for name in _HF_SIDE_FILES:
            if (Path(config_dir) / name).is_file():
                shutil.copy2(Path(config_dir) / name, out / name)
    return [k[len(prefix) :] for k, _ in entries]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert a committed DCP checkpoint to HF safetensors (offline).")
    parser.add_argument(
        "checkpoint_dir", help="a committed checkpoint directory, e.g. runs/x/checkpoints/step_00000100"
    )
    parser.add_argument("out_dir", help="output HF model directory")
    parser.add_argument("--config", help="HF model directory to copy config/tokenizer files from")
    parser.add_argument("--prefix", default="train.model.", help="key prefix of the model tensors in the checkpoint")
    parser.add_argument("--max-shard-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--skip", action="append", default=[], help="parameter names to leave out (tied aliases)")
    args = parser.parse_args(argv)
    names = convert_dcp_to_hf(
        args.checkpoint_dir,
        args.out_dir,
        config_dir=args.config,
        prefix=args.prefix,
        max_shard_bytes=args.max_shard_bytes,
        skip_keys=tuple(args.skip),
    )
    print(f"wrote {len(names)} tensors to {args.out_dir} ({INDEX_FILE} if sharded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
