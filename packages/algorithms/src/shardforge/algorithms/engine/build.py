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
from typing import Any

import torch
from torch import nn

from shardforge.algorithms.engine.context import ParallelContext
from shardforge.algorithms.engine.features import lora
from shardforge.algorithms.engine.features.moe import apply_moe, moe_training, reload_expert_tp, shard_experts
from shardforge.algorithms.engine.heads import Head, LMHead
from shardforge.algorithms.engine.runners import Runner, SPMDRunner
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
    reference = None
    if ctx.is_main:
        reference = head.materialize(source, hf_config, dtype=ctx.param_dtype, attn=attn, seed=config.seed)
        reference.config.use_cache = False
        lora.add_adapters(reference, config)  # adapter init travels in the broadcast
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
    if ctx.dims.tp > 1:
        sp = config.sequence_parallel
        plan = lora.tp_plan(model, head.tp_plan(model, sequence_parallel=sp), config)
        apply_tensor_parallel(model, ctx.mesh.get("tp"), plan=plan, sequence_parallel=sp)
    efsdp_mesh = apply_moe(model, ctx.dims, ctx.mesh)  # EP / expert TP (MoE models only)
    _tile_mlps(model, ctx)
    if ctx.dims.pp > 1:
        from shardforge.algorithms.engine.pipeline_runner import build_pipeline

        assert isinstance(head, LMHead)  # checks.check_engine refuses other heads with pp > 1
        stage_fsdp = dataclasses.replace(ctx.fsdp_config(), reshard_after_forward=False)
        return build_pipeline(
            ctx, head, hf_config, model, reference, lambda stage: shard_module(stage, ctx, efsdp_mesh, stage_fsdp)
        )
    ddp = config.data_parallel == "ddp"  # checks.check_features allows it on replicate-only layouts
    if ddp:
        apply_activation_checkpointing(model, ctx.ac_config())
    else:
        shard_module(model, ctx, efsdp_mesh)
    full = reference.state_dict() if reference is not None else None
    buffers = dict(reference.named_buffers()) if reference is not None else None
    load_full_state_dict(model, full, device=ctx.device, buffers=buffers)
    reload_expert_tp(model, full)  # expert-TP shards are row ranges the generic load misplaces
    del reference, full, buffers
    if ddp:  # DDP needs real tensors: replicate after the load (rank 0's weights are already everywhere)
        apply_replicate(model, ctx.mesh.get("dp_replicate"))
    return model, SPMDRunner(model, ctx, head, moe_training(model, hf_config, ctx))
