"""Tensor parallelism for vision-language models (Qwen2.5-VL, Qwen3-VL): `vlm_tp_plan`; and the sequence
chunking after the image merge that TP's sequence parallelism and Ulysses CP share
(`install_sequence_chunking`).

The language model gets its text family's plan (`shardforge.tensor_parallel.plans.dense_decoder_plan`,
with Qwen3's q/k norms for Qwen3-VL) under ``model.language_model``; the vision tower and its
merger(s) are not in the plan, so every TP rank holds them whole (FSDP shards them over the
data-parallel ranks only) and runs them on the same images.

Two changes to the text plan, both so the image embeddings meet full hidden states:

- The token embedding returns *replicated* full-length hidden states (its partial sums all-reduced),
  also under sequence parallelism: HF's VLM forward scatters the vision tower's output into them at
  the image tokens (``masked_scatter``), which needs every position.
- Under sequence parallelism the language model's input is cut to this rank's sequence chunk by a
  forward pre-hook (`_SequenceChunk`), after the scatter and before the first decoder layer; Qwen3-VL's
  DeepStack inputs (the image-token mask and the per-image-token features added after the first text
  layers) are cut to the same chunk. The cut's backward sums the chunks' gradients over the TP group,
  so the vision tower and the embedding receive the whole sequence's gradient on every TP rank.

The 3-D mRoPE position ids stay whole: the rotary cos/sin are computed for the full sequence and
each attention block all-gathers its input (SP) before applying them, exactly as for text models.
The LM head stays column-parallel: logits are vocab-sharded and the losses are vocab-parallel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["VLM_TP_FAMILIES", "install_sequence_chunking", "vlm_tp_plan"]

VLM_TP_FAMILIES: dict[str, bool] = {"qwen2_5_vl": False, "qwen3_vl": True}
"""VLM ``model_type`` with a TP plan -> whether its text attention has q/k norms (Qwen3)."""

_TEXT = "model.language_model"


def vlm_tp_plan(model: nn.Module, *, sequence_parallel: bool) -> dict[str, Any]:
    """The TP plan of a VLM (module docstring); a `ValueError` names the supported families."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    from shardforge.tensor_parallel.plans import dense_decoder_plan

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in VLM_TP_FAMILIES:
        raise ValueError(
            f"no tensor-parallel plan for the vision-language model_type={model_type!r}; supported: "
            f"{sorted(VLM_TP_FAMILIES)} (or use a data-parallel layout)"
        )
    text = dense_decoder_plan(sequence_parallel=sequence_parallel, qk_norm=VLM_TP_FAMILIES[model_type])
    plan = {(_TEXT + key[len("model") :] if key.startswith("model.") else key): style for key, style in text.items()}
    plan[f"{_TEXT}.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    return plan


class _SequenceChunk(torch.autograd.Function):
    """Forward: rows ``start:start+length`` of ``x`` along ``dim``. Backward: the chunk's gradient placed
    in a zero tensor of ``x``'s shape and summed over ``group`` (each rank's chunk differs, so the sum
    is the whole sequence's gradient, the same on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, start: int, length: int, group: Any) -> torch.Tensor:
        ctx.shape, ctx.dim, ctx.start, ctx.length, ctx.group = x.shape, dim, start, length, group
        return x.narrow(dim, start, length).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        full = grad.new_zeros(ctx.shape)
        full.narrow(ctx.dim, ctx.start, ctx.length).copy_(grad)
        dist.all_reduce(full, group=ctx.group)
        return full, None, None, None, None


def _chunk(x: torch.Tensor, dim: int, start: int, length: int, group: Any) -> torch.Tensor:
    if group is None or not x.requires_grad:
        return x.narrow(dim, start, length)
    out: torch.Tensor = _SequenceChunk.apply(x, dim, start, length, group)
    return out


def install_sequence_chunking(model: nn.Module, group: Any, rank: int, size: int, *, cp: bool = False) -> None:
    """Cut the language model's inputs to this rank's contiguous chunk of the sequence, after the image
    features are merged: under TP's sequence parallelism (module docstring; the chunks' gradients are
    summed over the TP group, positions stay whole) or, with ``cp``, under Ulysses context parallelism
    (as `shardforge.ulysses_cp.slice_for_rank`: the mRoPE positions are cut too, since each rank
    rotates its own chunk's queries and keys; gradients stay per chunk, and FSDP sums them over cp
    like every other parameter's)."""
    text = model.get_submodule(_TEXT)
    grad_group = None if cp else group

    def pre_hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        embeds = kwargs["inputs_embeds"]
        total = embeds.shape[1]
        if total % size:
            raise ValueError(f"sequence chunking needs a length divisible by {size}, got {total}")
        length = total // size
        start = rank * length
        kwargs["inputs_embeds"] = _chunk(embeds, 1, start, length, grad_group)
        if cp:
            kwargs["position_ids"] = kwargs["position_ids"].narrow(-1, start, length)
        mask = kwargs.get("visual_pos_masks")
        if mask is not None:  # Qwen3-VL DeepStack: features of the image tokens in this chunk only
            before = int(mask[:, :start].sum())
            mine = int(mask[:, start : start + length].sum())
            kwargs["visual_pos_masks"] = mask[:, start : start + length]
            deep = kwargs.get("deepstack_visual_embeds")
            if deep is not None:
                kwargs["deepstack_visual_embeds"] = [_chunk(d, 0, before, mine, grad_group) for d in deep]
        return args, kwargs

    text.register_forward_pre_hook(pre_hook, with_kwargs=True)
