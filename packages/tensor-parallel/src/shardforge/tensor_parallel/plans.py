"""Tensor-parallel plans as data: module path pattern -> `ParallelStyle`, one table per family.

Megatron-style TP with sequence parallelism (SP): between blocks activations are sharded
on the sequence dim (`Shard(1)`); each attention and MLP block all-gathers its input once
(`PrepareModuleInput`), runs column-parallel projections on local heads / intermediate
columns, and its row-parallel output projection reduce-scatters back to sequence shards.
Norm weights are replicated DTensors (`SequenceParallel`), so their gradients (partial
per sequence shard) are summed across the TP group by DTensor.

Qwen3's q_norm/k_norm normalise each head over head_dim: with heads split across ranks,
`SequenceParallel(sequence_dim=2)` treats the head dim as the sharded dim, which keeps the
weight replicated and sums its per-head-shard gradients.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["PLAN_BUILDERS", "TPPlan", "dense_decoder_plan", "plan_for_model", "supported_families"]

TPPlan = dict[str, ParallelStyle]
"""Module path (``*`` matches one path component) -> style, for `parallelize_module`."""


def _layer_attention(prefix: str, *, sp: bool, qk_norm: bool) -> TPPlan:
    seq = Shard(1) if sp else Replicate()
    plan: TPPlan = {
        f"{prefix}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            # Keep the gathered input a DTensor: q/k/v then share one input, so backward
            # does one reduce-scatter of its gradient instead of an all-reduce per projection.
            use_local_output=False,
        ),
        f"{prefix}.self_attn.q_proj": ColwiseParallel(),
        f"{prefix}.self_attn.k_proj": ColwiseParallel(),
        f"{prefix}.self_attn.v_proj": ColwiseParallel(),
        f"{prefix}.self_attn.o_proj": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        plan[f"{prefix}.input_layernorm"] = SequenceParallel()
        plan[f"{prefix}.post_attention_layernorm"] = SequenceParallel()
    if qk_norm:
        plan[f"{prefix}.self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan[f"{prefix}.self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _dense_mlp(prefix: str, *, sp: bool) -> TPPlan:
    seq = Shard(1) if sp else Replicate()
    return {
        f"{prefix}.mlp": PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        f"{prefix}.mlp.gate_proj": ColwiseParallel(),
        f"{prefix}.mlp.up_proj": ColwiseParallel(),
        f"{prefix}.mlp.down_proj": RowwiseParallel(output_layouts=seq),
    }


def _replicated_mlp(prefix: str, *, sp: bool) -> TPPlan:
    # The MoE block is not tensor-parallel here (expert parallelism is moe-ep's job): every
    # TP rank runs it on the full sequence, so its replicated weights get identical
    # gradients; under SP the output is re-sliced to this rank's sequence shard.
    if not sp:
        return {}
    return {
        f"{prefix}.mlp": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        ),
    }


def _model_level(*, sp: bool) -> TPPlan:
    seq = Shard(1) if sp else Replicate()
    plan: TPPlan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Vocab-sharded logits stay a DTensor: losses use vocab_parallel_* on them.
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["model.norm"] = SequenceParallel(use_local_output=True)
    return plan


def dense_decoder_plan(*, sequence_parallel: bool = True, qk_norm: bool = False) -> TPPlan:
    """Plan for Llama-style decoders (Llama, Qwen2, Qwen3, Mistral)."""
    layer = "model.layers.*"
    return {
        **_model_level(sp=sequence_parallel),
        **_layer_attention(layer, sp=sequence_parallel, qk_norm=qk_norm),
        **_dense_mlp(layer, sp=sequence_parallel),
    }


def moe_attention_plan(*, sequence_parallel: bool = True) -> TPPlan:
    """Plan for Qwen3-MoE: TP on attention; the MoE block stays replicated across TP ranks."""
    layer = "model.layers.*"
    return {
        **_model_level(sp=sequence_parallel),
        **_layer_attention(layer, sp=sequence_parallel, qk_norm=True),
        **_replicated_mlp(layer, sp=sequence_parallel),
    }


PLAN_BUILDERS: dict[str, Callable[[bool], TPPlan]] = {
    "llama": lambda sp: dense_decoder_plan(sequence_parallel=sp),
    "mistral": lambda sp: dense_decoder_plan(sequence_parallel=sp),
    "qwen2": lambda sp: dense_decoder_plan(sequence_parallel=sp),
    "qwen3": lambda sp: dense_decoder_plan(sequence_parallel=sp, qk_norm=True),
    "qwen3_moe": lambda sp: moe_attention_plan(sequence_parallel=sp),
}
"""HF ``config.model_type`` -> plan builder (argument: sequence_parallel)."""


def supported_families() -> list[str]:
    return sorted(PLAN_BUILDERS)


def plan_for_model(model: nn.Module, *, sequence_parallel: bool = True) -> TPPlan:
    """The built-in plan for ``model``'s family; a `ValueError` lists the supported ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PLAN_BUILDERS:
        raise ValueError(
            f"no tensor-parallel plan for model_type={model_type!r} ({type(model).__name__}); supported: "
            f"{supported_families()}. Pass your own plan: apply_tensor_parallel(model, tp_mesh, plan={{"
            "'model.layers.*.self_attn.q_proj': ColwiseParallel(), ...})"
        )
    return PLAN_BUILDERS[model_type](sequence_parallel)
