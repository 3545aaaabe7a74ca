"""`build_model`: THE composition order, written once (docs/parallelism.md links here).

    rank 0: materialise the full reference model (from disk or the config, ``seed``) [+ LoRA adapters]
    every rank, on the meta device: the head's HF class [+ LoRA adapters]
      -> tensor parallel (the head's plan, made LoRA-aware)
      -> (CP needs no module change: packed attention is registered, inputs are sliced)
      -> expert parallel / expert TP (MoE models)
      -> tiled MLP
      -> pipeline split into this rank's stages (pp > 1), then per stage the same tail:
      -> activation checkpointing -> expert FSDP over efsdp -> FSDP/HSDP   (`shard_module`)
      -> load rank 0's full state dict (broadcast) [+ expert-TP row ranges]
      (``engine.data_parallel=ddp`` on a replicate-only layout: AC -> load -> DDP over dp_replicate)

A single process without a process group builds the reference model alone (MoE experts use
the grouped matmul, tiled MLP and AC apply) and moves it to the device.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from shardforge.engine.context import ParallelContext
from shardforge.engine.features import lora
from shardforge.engine.features.freeze import freeze_module_prefixes
from shardforge.engine.features.moe import apply_moe, moe_training, reload_expert_tp, shard_experts
from shardforge.engine.heads import Head, LMHead
from shardforge.engine.runners import Runner, SPMDRunner
from shardforge.fsdp_wrap import (
    FSDPConfig,
    apply_activation_checkpointing,
    apply_fsdp,
    apply_replicate,
    load_full_state_dict,
)
from shardforge.memory import apply_tiled_mlp
from shardforge.tensor_parallel import apply_tensor_parallel
from shardforge.ulysses_cp import register_packed_attention

__all__ = ["build_model", "shard_module"]


def _tile_mlps(model: nn.Module, ctx: ParallelContext) -> None:
    if ctx.config.tiled_mlp_shards > 1:
        apply_tiled_mlp(model, ctx.config.tiled_mlp_shards)


def shard_module(
    module: nn.Module, ctx: ParallelContext, efsdp_mesh: Any, fsdp_config: FSDPConfig | None = None
) -> None:
    """The tail of the composition order on one module (the whole model, or one pipeline stage):
    activation checkpointing -> experts as their own FSDP units over efsdp -> FSDP/HSDP."""
    fsdp_config = fsdp_config or ctx.fsdp_config()
    apply_activation_checkpointing(module, ctx.ac_config())
    shard_experts(module, efsdp_mesh, ctx.dims, fsdp_config)  # experts over efsdp, first
    fsdp_mesh = ctx.fsdp_mesh()
    if fsdp_mesh is not None:
        apply_fsdp(module, fsdp_mesh, fsdp_config)


def build_model(ctx: ParallelContext, head: Head, hf_config: Any, source: Any) -> tuple[nn.Module, Runner]:
    """Build, shard and load the model of ``source`` (a directory or a config) on ``ctx``'s layout;
    return it with the runner for that layout. Collective over every rank."""
    attn = register_packed_attention()
    config = ctx.config
    if ctx.distributed:
        quiet_dtensor_multi_collective_hint()
    reference = None
    if ctx.is_main:
        reference = head.materialize(source, hf_config, dtype=ctx.param_dtype, attn=attn, seed=config.seed)
        reference.config.use_cache = False
        lora.add_adapters(reference, config)  # adapter init travels in the broadcast
        freeze_module_prefixes(reference, config.freeze_module_prefix)
    if not ctx.distributed:
        assert reference is not None
        apply_moe(reference, ctx.dims, None)
        _tile_mlps(reference, ctx)
        apply_activation_checkpointing(reference, ctx.ac_config())
        model = reference.to(ctx.device)
        return model, SPMDRunner(model, ctx, head, moe_training(model, hf_config, ctx))
    assert ctx.mesh is not None
    with torch.device("meta"):
        model = head.model_class().from_config(hf_config, dtype=ctx.param_dtype, attn_implementation=attn)
    model.config.use_cache = False
    lora.add_adapters(model, config)
    freeze_module_prefixes(model, config.freeze_module_prefix)  # before TP/FSDP: they keep requires_grad
    if ctx.dims.tp > 1:
        sp = config.sequence_parallel
        plan = lora.tp_plan(model, head.tp_plan(model, sequence_parallel=sp), config)
        apply_tensor_parallel(model, ctx.mesh.get("tp"), plan=plan, sequence_parallel=sp)
        _embedding_output_not_a_view(model)
    head.adapt_to_layout(model, ctx)  # e.g. a VLM cuts its language model's input for SP / CP
    efsdp_mesh = apply_moe(model, ctx.dims, ctx.mesh)  # EP / expert TP (MoE models only)
    _tile_mlps(model, ctx)
    if ctx.dims.pp > 1:
        from shardforge.engine.pipeline_runner import build_pipeline

        assert isinstance(head, LMHead)  # checks.check_engine refuses other heads with pp > 1
        stage_fsdp = dataclasses.replace(ctx.fsdp_config(), reshard_after_forward=False)
        return build_pipeline(
            ctx, head, hf_config, model, reference, lambda stage: shard_module(stage, ctx, efsdp_mesh, stage_fsdp)
        )
    ddp = config.data_parallel == "ddp"  # checks.check_features allows it on replicate-only layouts
    if ddp:
        apply_activation_checkpointing(model, ctx.ac_config())
    else:
        keep = head.keep_input_dtype_classes(model)  # e.g. a VLM's vision blocks: fp32 rotary cos/sin stay fp32
        shard_module(model, ctx, efsdp_mesh, dataclasses.replace(ctx.fsdp_config(), keep_input_dtype_classes=keep))
    full = reference.state_dict() if reference is not None else None
    buffers = dict(reference.named_buffers()) if reference is not None else None
    load_full_state_dict(model, full, device=ctx.device, buffers=buffers)
    reload_expert_tp(model, full)  # expert-TP shards are row ranges the generic load misplaces
    del reference, full, buffers
    if ddp:  # DDP needs real tensors: replicate after the load (rank 0's weights are already everywhere)
        apply_replicate(model, ctx.mesh.get("dp_replicate"))
    if not isinstance(head, LMHead):
        _value_output_not_a_view(model)
    return model, SPMDRunner(model, ctx, head, moe_training(model, hf_config, ctx))


def _own_output(module: nn.Module, args: Any, output: Any) -> Any:
    is_view = isinstance(output, torch.Tensor) and bool(output._is_view())
    return output.clone() if is_view else output


def _embedding_output_not_a_view(model: nn.Module) -> None:
    """TP's vocab-parallel embedding returns ``DTensor.to_local()``, a view; FSDP2 then warns on every
    step that an in-place op on it would skip its all-gather. Hand FSDP a copy instead (one [T, hidden]
    tensor per step). Registered after TP's output hook and before FSDP's, so it runs between them."""
    embedding: Any = model.get_input_embeddings()  # type: ignore[operator]  # an HF PreTrainedModel
    if isinstance(embedding, nn.Module):
        embedding.register_forward_hook(_own_output)


def _value_output_not_a_view(model: nn.Module) -> None:
    """A value / reward head's ``score`` Linear maps [1, T, hidden] to [1, T, 1] through a 2-D matmul,
    so its output is a view, which the FSDP root then returns (and warns about every step). A copy
    of [T] floats avoids it; the score module runs before the root's post-forward hook."""
    score = getattr(model, "score", None)
    if isinstance(score, nn.Module):
        score.register_forward_hook(_own_output)


_DTENSOR_HINTS = ("sequential all_reduce operations will be performed", "sequential all_gather operations will be")


class _DropDTensorHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(hint in message for hint in _DTENSOR_HINTS)


def quiet_dtensor_multi_collective_hint() -> None:
    """Drop exactly DTensor's "N sequential all_reduce / all_gather operations" hint (once per rank per
    shape, at the first grad-norm clip and the first full-state gather of a 2-D (dp_shard x tp) layout).

    It is a latency hint, and its "may give inconsistent results between ranks" does not apply here:
    every all_reduce / all_gather hands all members of its group the same bytes, and every rank runs
    the same sequence, so all ranks end with identical values. Proven by
    integration_tests/test_sft_layouts.py::test_sft_matches_world1[fsdp2xtp2] (losses and weights vs
    one process) and the grad-norm equality in test_rl_layouts.py. Any other DTensor message still shows.
    """
    target = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _DropDTensorHint) for f in target.filters):
        target.addFilter(_DropDTensorHint())
