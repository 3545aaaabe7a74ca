"""Export, weight publishing and checkpoints of a `TrainEngine` (the engine's I/O methods).

A mixin so engine.py keeps the model building and the compute paths; every method here is
collective over the engine's ranks and works on any layout (FSDP/HSDP/TP/CP/EP, pp stages).
LoRA engines export and publish merged weights and checkpoint only the adapters; engines with
``offload_when_idle`` bring their weights to the device for each call.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from shardforge.algorithms import lora_support, pipeline_support
from shardforge.algorithms.config import EngineConfig, parse_dtype
from shardforge.algorithms.offload import OffloadState, offloaded_between_calls
from shardforge.checkpoint_dcp import Checkpointer, TrainState, export_hf
from shardforge.weight_sync import PublishStats, WeightPublisher, WeightTransport

if TYPE_CHECKING:
    from shardforge.algorithms.engine import TrainEngine
    from shardforge.algorithms.pipeline_support import EnginePipeline

__all__ = ["EngineIO", "replace_attn"]


class EngineIO:
    """Export / publish / checkpoint methods; mixed into `TrainEngine`, which sets these attributes."""

    config: EngineConfig
    hf_config: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int
    pipeline: EnginePipeline | None
    offload_state: OffloadState | None = None

    def _engine(self) -> TrainEngine:
        return cast("TrainEngine", self)

    # ------------------------------------------------------------------ export
    @offloaded_between_calls
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state dict on rank 0's CPU; an empty dict elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.pipeline is not None:
            return pipeline_support.pp_full_state_dict(self._engine())
        with lora_support.merged_weights(self.model, self.config):  # LoRA: merged HF weights
            if not dist.is_initialized():
                return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(self.model, options=options)
        return dict(state) if dist.get_rank() == 0 else {}  # type: ignore[arg-type]

    @offloaded_between_calls
    def export_hf(self, out_dir: str | os.PathLike[str], tokenizer: Any = None, *, dtype: str | None = None) -> None:
        """Write an HF model directory (sharded safetensors + index + config [+ tokenizer]).

        Streams one parameter at a time to rank 0 (see `shardforge.checkpoint_dcp.export_hf`).
        """
        if self.pipeline is not None:
            out_dtype = parse_dtype(dtype) if dtype else None
            return pipeline_support.pp_export_hf(
                self._engine(), out_dir, replace_attn(self.hf_config), tokenizer, out_dtype
            )
        with lora_support.merged_weights(self.model, self.config):  # LoRA: the merged model
            export_hf(
                self.model,
                out_dir,
                replace_attn(self.hf_config),
                tokenizer,
                dtype=parse_dtype(dtype) if dtype else None,
            )

    @offloaded_between_calls
    def export_lora(self, out_dir: str | os.PathLike[str], base_model_name_or_path: str | None = None) -> None:
        """Write the LoRA adapters in PEFT format (``PeftModel.from_pretrained(base, out_dir)``). Collective."""
        lora_support.export_lora(self, out_dir, base_model_name_or_path)

    @offloaded_between_calls
    def publish_weights(
        self,
        transport: WeightTransport | None,
        version: int | None = None,
        *,
        bucket_bytes: int = 256 * 1024**2,
        dtype: str | torch.dtype | None = None,
        src_rank: int = 0,
    ) -> PublishStats | None:
        """Push the current weights to inference engines through ``transport`` (weight-sync).

        Collective over all ranks; ``transport`` is needed on ``src_rank`` only (None elsewhere).
        Tensors are gathered bucket by bucket in HF naming, cast to ``dtype`` (e.g. "bf16") before
        they move. ``version`` defaults to the engine's step. Returns stats on ``src_rank``.
        """
        publisher = WeightPublisher(
            self.model,
            transport,
            bucket_bytes=bucket_bytes,
            dtype=parse_dtype(dtype) if dtype is not None else None,
            src_rank=src_rank,
        )
        with lora_support.merged_weights(self.model, self.config):  # LoRA: publish merged HF weights
            return publisher.publish(self.step if version is None else version)

    # ------------------------------------------------------------------ checkpoints
    def train_state(self, data_state: dict[str, Any] | None = None) -> TrainState:
        """A `TrainState` over this engine's model, optimizer, scheduler and step."""
        # LoRA: adapters (+ their optimizer state) only; the frozen base comes from the model path.
        trainable_only = self.config.lora is not None
        return TrainState(
            self.model,
            self.optimizer,
            self.scheduler,
            step=self.step,
            data_state=data_state,
            trainable_only=trainable_only,
        )

    @offloaded_between_calls
    def save(self, checkpointer: Checkpointer, data_state: dict[str, Any] | None = None) -> None:
        """Save the engine at its current step through ``checkpointer``. Collective."""
        checkpointer.save(self.step, {"train": self.train_state(data_state)})

    @offloaded_between_calls
    def load(self, checkpointer: Checkpointer, step: int | str = "latest") -> dict[str, Any] | None:
        """Load a checkpoint (any layout); return its data state, or None if there is none."""
        if self.pipeline is not None:
            return pipeline_support.pp_load(self._engine(), checkpointer, step)
        state = self.train_state()
        loaded = checkpointer.load({"train": state}, step=step)  # type: ignore[arg-type]
        if loaded is None:
            return None
        self.step = state.step
        return state.data_state


def replace_attn(hf_config: Any) -> Any:
    """A copy of ``hf_config`` whose saved attention implementation is plain SDPA."""
    import copy

    config = copy.deepcopy(hf_config)
    config._attn_implementation = "sdpa"
    return config
