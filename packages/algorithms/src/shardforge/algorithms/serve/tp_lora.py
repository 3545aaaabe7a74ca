"""LoRA tenants on a tensor-parallel base (`shardforge serve --layout t2` / ``d2t2``): the frozen base is built by
the engine with the trainers' TP plan and sequence parallelism (``EngineConfig.sequence_parallel``, on by default),
while each tenant's adapters stay full-size plain tensors replicated on every rank. A forward hook on each Linear
adds the tenants' LoRA terms using the slice of each adapter that the rank's base shard needs.

The datums run packed end to end ([1, T], positions restarting per datum, packed attention over ``cu_seqlens``), as
the trainers' TP path runs them: sequence parallelism shards the hidden states on the token dim between blocks,
which a padded [B, S] batch with an attention mask cannot pass through the HF model. T is padded to a multiple of
tp with a sequence of its own (`engine.batching.pad_to_multiple`). The LM head's logits stay vocab-sharded and the
log-probs are `tensor_parallel.vocab_parallel_logprobs` (no rank gathers the vocabulary).

Per Linear, given the rank's TP coordinate t of tp (K = the batch's tenants' ranks summed, s = scaling):

- column-parallel (q/k/v, gate/up, lm_head: input replicated, output features sharded):
  ``delta_t = s * (x A^T) B_t^T`` with ``B_t`` the rows of B for this rank's output shard. The input's
  gradient from the delta is this rank's share of a sum (``to_local(grad_placements=[Partial()])``, like the base
  Linear's own input gradient).
- row-parallel (o_proj, down_proj: input features sharded, output reduce-scattered over tokens by the base):
  ``h = sum over t of x_t A_t^T`` (``A_t`` the columns of A for this rank's input shard), reduce-scattered over the
  tokens like the base output (an [1, T, K] collective, autograd through DTensor), then ``delta = s * h B^T`` is
  added to the already reduced, token-sharded output.

Gradients (each rank holds a full-size gradient tensor per adapter; the autograd of the slicing writes zeros
outside the slice a rank uses):

====================  =====================================  ==================================
adapter               what rank t computes                   the 1-rank gradient is
====================  =====================================  ==================================
column A [K, I]       its output shard's part of the sum     the sum over t
column B [O, K]       rows of its output shard, exactly      the sum over t (others are zero)
row A [K, I]          columns of its input shard, exactly    the sum over t (others are zero)
row B [O, K]          its token shard's part of the sum      the sum over t
====================  =====================================  ==================================

So with sequence parallelism every adapter's gradient is the sum of the ranks' gradients over the TP group, as it
is over the data-parallel ranks: `adapter_grad_group` is the whole world, and ``op_optim_step`` sums over it once.
(Without sequence parallelism the row-parallel B would be computed redundantly on every TP rank: summing would
count it tp times, so the serve path requires it.)

Legend: T = tokens of the rank's datums packed end to end (padded to a multiple of tp), I / O = a Linear's input /
output features, K = the tenants' LoRA ranks summed, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardforge.algorithms.serve.batching import _Rows
from shardforge.algorithms.serve.codecs import WireDatum
from shardforge.lora import LoRALinear

__all__ = ["TPLoRATree", "adapter_grad_group", "check_tp_base"]


def check_tp_base(hf_config: Any, tp: int, *, sequence_parallel: bool) -> None:
    """ValueError unless the base can be split over ``tp`` ranks (heads, KV heads, vocabulary and MLP divisible) with
    sequence parallelism (which the adapters' gradient reduction relies on, see the module doc)."""
    from shardforge.tensor_parallel import validate_tp

    validate_tp(hf_config, tp)
    if not sequence_parallel:
        raise ValueError(
            "shardforge serve with tp > 1 needs engine sequence parallelism (the trainers' default): without it the "
            "row-parallel adapters' B gradients are computed redundantly on every TP rank"
        )


def adapter_grad_group(tp: int, dp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group over which the ranks' adapter gradients sum to the 1-rank gradient: the data-parallel ranks, and
    with tp > 1 also the TP ranks (the whole world; see the module doc)."""
    return dist.group.WORLD if tp > 1 else dp_group


@dataclass(frozen=True, slots=True)
class _Span:
    """Tokens ``start:stop`` of the packed batch use ``adapters`` (adapted Linear names -> a tenant's LoRALinear)."""

    start: int
    stop: int
    adapters: dict[str, LoRALinear]


class TPLoRATree:
    """Forward hooks on a tensor-parallel base's Linears that add the running batch's tenants' adapters (see the
    module doc). `logprobs` runs a batch.

    Args:
        base: the base model built by `engine.build.build_model` on a layout with tp > 1 (frozen).
        tp: the layout's tp (the packed tokens are padded to a multiple of it: sequence parallelism splits them).
    """

    def __init__(self, base: nn.Module, *, tp: int) -> None:
        self.base = base
        self.tp = tp
        self._spans: list[_Span] | None = None
        for name, module in base.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._hook(name))

    def logprobs(self, datums: Sequence[WireDatum], plan: list[_Rows]) -> torch.Tensor:
        """[T] log pi(target_t | tokens_<=t) of ``datums`` packed in order, rows ``plan[i].start:stop`` through
        ``plan[i]``'s adapters (differentiable when grad is enabled). Collective over the TP group."""
        from shardforge.engine.batching import pack_sequences, pad_to_multiple
        from shardforge.tensor_parallel import vocab_parallel_logprobs
        from shardforge.ulysses_cp import packed_model_kwargs

        lengths = [len(d.tokens) for d in datums]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        spans = [_Span(offsets[rows.start], offsets[rows.stop], rows.adapters) for rows in plan]
        packed = pad_to_multiple(pack_sequences([d.tokens for d in datums]), self.tp)
        targets = torch.cat([d.inputs["target_tokens"].long() for d in datums])
        targets = torch.cat([targets, targets.new_zeros(packed.num_tokens - targets.numel())])
        device = next(self.base.parameters()).device
        kwargs = packed_model_kwargs(packed.cu_seqlens.to(device))
        self._spans = spans
        try:
            logits = self.base(
                input_ids=packed.input_ids.to(device)[None],
                position_ids=packed.position_ids.to(device)[None],
                use_cache=False,
                **kwargs,
            ).logits[0]
        finally:
            self._spans = None
        if isinstance(logits, DTensor):  # vocab-sharded (the TP plan's lm_head): never gathered
            logprobs_T = vocab_parallel_logprobs(logits, targets.to(device))
        else:
            logprobs_T = F.log_softmax(logits.float(), dim=-1).gather(-1, targets.to(device)[:, None])[:, 0]
        return logprobs_T[: offsets[-1]]

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        def add_adapters(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            spans = self._spans
            if spans is None:
                return out
            loras = [span.adapters.get(name) for span in spans]
            if all(lora is None for lora in loras):
                return out
            return _add_delta(args[0], out, spans, loras)

        return add_adapters


def _scales(spans: list[_Span], loras: list[LoRALinear | None], tokens: int, like: torch.Tensor) -> torch.Tensor:
    """[T, K]: each token's own tenant's columns scaled, the others' zero (exact zeros: no tenant's term or
    gradient reaches another's rows); padding tokens after the last span get none."""
    ranks = [lora.lora_A.weight.shape[0] for lora in loras if lora is not None]
    scale_TK = like.new_zeros((tokens, sum(ranks)))
    column = 0
    for span, lora in zip(spans, loras, strict=True):
        if lora is not None:
            rank = lora.lora_A.weight.shape[0]
            scale_TK[span.start : span.stop, column : column + rank] = lora.lora_scaling
            column += rank
    return scale_TK


def _add_delta(x: Any, out: Any, spans: list[_Span], loras: list[LoRALinear | None]) -> Any:
    """``out`` plus the tenants' LoRA terms of this Linear (its input ``x``; see the module doc)."""
    present = [lora for lora in loras if lora is not None]
    if not all(isinstance(lora.lora_dropout, nn.Identity) for lora in present):
        raise ValueError("LoRA dropout is not supported with tp > 1 (the service's adapters have none)")
    a_KI = torch.cat([lora.lora_A.weight for lora in present])
    b_OK = torch.cat([lora.lora_B.weight for lora in present], dim=1)
    if not isinstance(x, DTensor):  # a Linear the TP plan leaves whole
        scale_TK = _scales(spans, loras, x.shape[-2], x)
        return out + F.linear(F.linear(x, a_KI) * scale_TK, b_OK)
    (placement,) = x.placements  # the Linear's input on the 1-D TP mesh
    mesh = x.device_mesh
    tp, me = mesh.size(), mesh.get_local_rank()
    if isinstance(placement, Replicate):  # column-parallel: B's rows for this rank's output features
        x_local = x.to_local(grad_placements=[Partial()])  # this rank's share of the input's gradient
        scale_TK = _scales(spans, loras, x_local.shape[-2], x_local)
        b_local = b_OK.chunk(tp, dim=0)[me]
        delta = F.linear(F.linear(x_local, a_KI) * scale_TK, b_local)
    elif isinstance(placement, Shard) and placement.dim in (-1, x.ndim - 1):  # row-parallel: A's input columns
        x_local = x.to_local()
        scale_TK = _scales(spans, loras, x_local.shape[-2], x_local)
        a_local = a_KI.chunk(tp, dim=1)[me]
        partial = F.linear(x_local, a_local) * scale_TK  # this rank's input shard's part of x A^T
        sharded = Shard(1) if _token_sharded(out, x) else Replicate()
        # summed over the TP group (reduce-scattered over the tokens like the base's output), with autograd
        h = DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [sharded]).to_local()
        delta = F.linear(h, b_OK)
    else:
        raise ValueError(f"no LoRA TP rule for a Linear whose input is placed {x.placements}")
    if isinstance(out, DTensor):  # the LM head keeps its vocab-sharded logits a DTensor
        local = out.to_local() + delta.to(out.dtype)
        return DTensor.from_local(local, out.device_mesh, out.placements, shape=out.shape, stride=out.stride())
    if out.shape != delta.shape:
        raise AssertionError(f"LoRA delta {tuple(delta.shape)} does not match the base shard {tuple(out.shape)}")
    return out + delta


def _token_sharded(out: Any, x: DTensor) -> bool:
    """Whether a row-parallel Linear's (local) output holds this rank's token shard (sequence parallelism)."""
    local = out.to_local() if isinstance(out, DTensor) else out
    return bool(local.shape[-2] != x.shape[-2])
