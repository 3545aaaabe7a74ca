"""Export, weight publishing and checkpoints of a `TrainEngine` (the engine's I/O methods).

A mixin so engine.py keeps the compute path; every method here is collective over the engine's
ranks, works on any layout through the engine's runner (full tensors, checkpoint loading), and
never branches on the layout. LoRA engines export and publish merged weights and checkpoint only
the adapters; engines with ``offload_when_idle`` bring their weights to the device for each call.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.checkpoint_dcp import Checkpointer, TrainState
from shardforge.engine.config import EngineConfig, parse_dtype
from shardforge.engine.features import lora
from shardforge.engine.features.offload import OffloadState, offloaded_between_calls
from shardforge.engine.runners import Runner
from shardforge.weight_sync import PublishStats, WeightPublisher, WeightTransport

__all__ = ["EngineIO", "finish_hf_export", "replace_attn"]


class EngineIO:
    """Export / publish / checkpoint methods; mixed into `TrainEngine`, which sets these attributes."""

    config: EngineConfig
    hf_config: Any
    model: nn.Module
    runner: Runner
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int
    offload_state: OffloadState | None = None
    base_use_cache: bool = True

    # ------------------------------------------------------------------ export
    @offloaded_between_calls
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state dict on rank 0's CPU; an empty dict elsewhere."""
        with lora.merged_weights(self.model, self.config):  # LoRA: merged HF weights
            return self.runner.full_state_dict()

    @offloaded_between_calls
    def export_hf(self, out_dir: str | os.PathLike[str], tokenizer: Any = None, *, dtype: str | None = None) -> None:
        """Write an HF model directory (sharded safetensors + index + config [+ tokenizer]).

        Streams one parameter at a time to rank 0 (see `shardforge.checkpoint_dcp.export_hf`).
        """
        config = replace_attn(self.hf_config, use_cache=self.base_use_cache)
        with lora.merged_weights(self.model, self.config):  # LoRA: the merged model
            self.runner.export_hf(out_dir, config, tokenizer, parse_dtype(dtype) if dtype else None)
        if not dist.is_initialized() or dist.get_rank() == 0:
            finish_hf_export(Path(out_dir), config)

    @offloaded_between_calls
    def export_lora(self, out_dir: str | os.PathLike[str], base_model_name_or_path: str | None = None) -> None:
        """Write the LoRA adapters in PEFT format (``PeftModel.from_pretrained(base, out_dir)``). Collective."""
        lora.export_lora(self.model, self.config, self.hf_config, out_dir, base_model_name_or_path)

    @offloaded_between_calls
    def publish_weights(
        self,
        transport: WeightTransport | None,
        version: int | None = None,
        *,
        bucket_bytes: int = 256 * 1024**2,
        dtype: str | torch.dtype | None = None,
        src_rank: int | None = 0,
        checksums: bool | str | None = "crc32",
    ) -> PublishStats | None:
        """Push the current weights to inference engines through ``transport`` (weight-sync).

        Collective over all ranks; ``transport`` is needed on ``src_rank`` only (None elsewhere;
        ``src_rank=None``: every rank receives the full weights into its own transport).
        Tensors are gathered bucket by bucket in HF naming, cast to ``dtype`` (e.g. "bf16") before
        they move. ``version`` defaults to the engine's step. ``checksums``: per-tensor checksums
        in the manifest (None: none, e.g. for an in-process receiver). Returns stats on ``src_rank``.
        """
        publisher = WeightPublisher(
            self.model,
            transport,
            bucket_bytes=bucket_bytes,
            dtype=parse_dtype(dtype) if dtype is not None else None,
            src_rank=src_rank,
            checksums=checksums,
        )
        with lora.merged_weights(self.model, self.config):  # LoRA: publish merged HF weights
            return publisher.publish(self.step if version is None else version)

    # ------------------------------------------------------------------ checkpoints
    def train_state(self, data_state: dict[str, Any] | None = None) -> TrainState:
        """A `TrainState` over this engine's model, optimizer, scheduler and step."""
        # LoRA: adapters (+ their optimizer state) only; the frozen base comes from the model path.
        return TrainState(
            self.model,
            self.optimizer,
            self.scheduler,
            step=self.step,
            data_state=data_state,
            trainable_only=self.config.lora is not None,
        )

    @offloaded_between_calls
    def save(self, checkpointer: Checkpointer, data_state: dict[str, Any] | None = None) -> None:
        """Save the engine at its current step through ``checkpointer``. Collective."""
        checkpointer.save(self.step, {"train": self.train_state(data_state)})

    @offloaded_between_calls
    def load(self, checkpointer: Checkpointer, step: int | str = "latest") -> dict[str, Any] | None:
        """Load a checkpoint (any layout); return its data state, or None if there is none."""
        state = self.train_state()
        if not self.runner.load(checkpointer, state, step):
            return None
        self.step = state.step
        return state.data_state


def replace_attn(hf_config: Any, *, use_cache: bool | None = None) -> Any:
    """A copy of ``hf_config`` whose saved attention implementation is plain SDPA (and, when given,
    the base model's ``use_cache``: training turns the KV cache off, ``generate`` wants it)."""
    config = copy.deepcopy(hf_config)
    config._attn_implementation = "sdpa"
    if use_cache is not None:
        config.use_cache = use_cache
    return config


_LOAD_TIME_TOKENIZER_KEYS = ("is_local", "local_files_only")
"""Keys `from_pretrained` records in a tokenizer's init kwargs that describe how *we* loaded it;
saved, they would make a user's plain ``AutoTokenizer.from_pretrained(export)`` refuse the Hub."""


def finish_hf_export(out_dir: Path, config: Any) -> None:
    """What a plain HF user needs besides weights + config (rank 0): a ``generation_config.json``
    (the base model's, else one derived from the config) and a tokenizer config without load-time keys."""
    from transformers import GenerationConfig

    source = Path(str(getattr(config, "_name_or_path", "") or ""))
    if (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out_dir / "generation_config.json")
    elif not (out_dir / "generation_config.json").exists():
        GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    tokenizer_config = out_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        data = json.loads(tokenizer_config.read_text())
        if any(key in data for key in _LOAD_TIME_TOKENIZER_KEYS):
            for key in _LOAD_TIME_TOKENIZER_KEYS:
                data.pop(key, None)
            tokenizer_config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
