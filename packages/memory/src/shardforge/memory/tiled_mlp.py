"""Sequence-tiled decoder MLP: the [T, intermediate] activation never exists for the whole sequence.

A SwiGLU MLP ``down(act(gate(x)) * up(x))`` keeps, for backward, the gate and up
projections and their product: about ``3 x T x intermediate`` values, 3-4x the size of its
[T, hidden] input and output (intermediate is 3-4x hidden). The MLP is token-wise, so it
can run on sequence chunks independently (the idea of Arctic Long Sequence Training's
TiledMLP, arXiv:2506.13996): `apply_tiled_mlp` makes each dense MLP

* in forward, run ``num_shards`` chunks of the sequence one after the other under no-grad
  and keep only its input, and
* in backward, recompute one chunk at a time with grad enabled and backpropagate it at
  once: ``torch.autograd.grad`` w.r.t. the chunk and the MLP's parameters, summing the
  parameter gradients over chunks and returning them from the autograd.Function.

Returning the parameter gradients (instead of calling ``backward`` inside backward) keeps
this an ordinary autograd node: the gradients reach each parameter's ``AccumulateGrad``
like a Linear's would, so ``torch.autograd.grad`` callers, FSDP2 (its unsharded parameters
get ``.grad`` before the layer's reduce-scatter) and activation checkpointing of the whole
decoder layer compose with it.

Shapes: ``x_BSH`` ([B, S, H]; packed batches are [1, T, H]) or ``x_TH``; chunks split the
second-to-last dim (the sequence), uneven when it does not divide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["apply_tiled_mlp"]

# A dense decoder MLP is a module named ``mlp`` with these children (Llama, Mistral, Qwen2,
# Qwen3, and the dense layers of Qwen3-MoE). Routed MoE blocks (``experts``) are skipped.
DENSE_MLP_CHILDREN = ("gate_proj", "up_proj", "down_proj")
MOE_MARKER = "experts"
_STATE_ATTR = "_shardforge_tiled_mlp"


@dataclass(kw_only=True, slots=True)
class _TiledMLPState:
    num_shards: int
    """How many sequence chunks the MLP computes one after the other."""
    original_forward: Any
    """The MLP's forward before tiling (a bound method); runs one chunk."""


def _trainable_params(module: nn.Module) -> list[torch.Tensor]:
    # Looked up on every call: FSDP2 swaps sharded and unsharded parameters in and out of
    # the module, and the unsharded ones are what forward and backward actually use.
    return [p for p in module.parameters() if p.requires_grad]


def _split(t: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, ...]:
    return torch.tensor_split(t, num_shards, dim=-2)


def _run_chunks(forward: Any, x: torch.Tensor, num_shards: int) -> torch.Tensor:
    """``forward`` on each sequence chunk, written into one output tensor."""
    out: torch.Tensor | None = None
    offset = 0
    for x_c in _split(x, num_shards):
        y_c = forward(x_c)
        if y_c.shape[:-1] != x_c.shape[:-1]:
            raise NotImplementedError(
                f"tiled MLP needs an MLP that maps each input token to one output token, but a chunk of shape "
                f"{tuple(x_c.shape)} gave {tuple(y_c.shape)}. Under tensor parallelism with sequence parallelism "
                "the MLP's output is a sequence shard; apply tiled MLP without sequence parallelism, or not at all."
            )
        if out is None:
            out = y_c.new_empty((*x.shape[:-1], y_c.shape[-1]))
        out.narrow(-2, offset, y_c.shape[-2]).copy_(y_c)
        offset += y_c.shape[-2]
    assert out is not None
    return out


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, module: nn.Module, state: _TiledMLPState, num_shards: int, x: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.module = module
        ctx.state = state
        ctx.num_shards = num_shards
        ctx.num_params = len(params)
        ctx.save_for_backward(x)  # only the input: chunks are recomputed in backward
        return _run_chunks(state.original_forward, x, num_shards)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        params = _trainable_params(ctx.module)
        if len(params) != ctx.num_params:
            raise RuntimeError(
                f"tiled MLP: {ctx.num_params} trainable parameters in forward but {len(params)} in backward; "
                "do not change requires_grad between forward and backward"
            )
        need_x = bool(ctx.needs_input_grad[3])
        grad_x = torch.empty_like(x) if need_x else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        offset = 0
        for x_c, g_c in zip(_split(x, ctx.num_shards), _split(grad_out, ctx.num_shards)):
            x_c = x_c.detach().requires_grad_(need_x)
            with torch.enable_grad():
                y_c = ctx.state.original_forward(x_c)
            inputs = [x_c, *params] if need_x else list(params)
            grads = torch.autograd.grad(y_c, inputs, g_c, allow_unused=True)
            if need_x:
                assert grad_x is not None
                grad_x.narrow(-2, offset, x_c.shape[-2]).copy_(grads[0])
                grads = grads[1:]
            offset += x_c.shape[-2]
            for i, g in enumerate(grads):
                if g is not None:
                    acc = grad_params[i]
                    grad_params[i] = g if acc is None else acc.add_(g)
        return (None, None, None, grad_x, *grad_params)


def _tiled_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    state: _TiledMLPState = getattr(self, _STATE_ATTR)
    if x.dim() < 2:
        raise ValueError(f"tiled MLP expects [B, S, H] or [T, H] input, got shape {tuple(x.shape)}")
    num_shards = max(1, min(state.num_shards, x.shape[-2]))  # no empty chunks
    params = _trainable_params(self)
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return _run_chunks(state.original_forward, x, num_shards)  # nothing to backpropagate
    out: torch.Tensor = _TiledMLPFunction.apply(self, state, num_shards, x, *params)
    return out


def _is_dense_mlp(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, c, None), nn.Module) for c in DENSE_MLP_CHILDREN) and not hasattr(
        module, MOE_MARKER
    )


def apply_tiled_mlp(model: nn.Module, num_shards: int) -> int:
    """Compute every dense decoder MLP of ``model`` in ``num_shards`` sequence chunks; return how many.

    In place, without renaming parameters (only the MLP's ``forward`` is replaced); calling
    it again changes ``num_shards``. Detected: modules named ``mlp`` with ``gate_proj``,
    ``up_proj`` and ``down_proj`` (Llama, Mistral, Qwen2, Qwen3, dense Qwen3-MoE layers);
    routed MoE blocks (with ``experts``) are skipped. The MLP must be token-wise and free of
    randomness (no dropout): each chunk's forward runs twice. Apply before FSDP or after,
    with or without activation checkpointing of the decoder layers.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards={num_shards!r} must be an int >= 1 (the number of sequence chunks)")
    tiled = 0
    skipped_moe: list[str] = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "mlp":
            continue
        if hasattr(module, MOE_MARKER):
            skipped_moe.append(name)
            continue
        if not _is_dense_mlp(module):
            continue
        dropouts = [n for n, m in module.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
        if dropouts:
            raise ValueError(f"{name} has dropout ({dropouts}); tiled MLP recomputes chunks, so it needs p=0")
        state = getattr(module, _STATE_ATTR, None)
        if state is None:
            setattr(module, _STATE_ATTR, _TiledMLPState(num_shards=num_shards, original_forward=module.forward))
            # An instance attribute: nn.Module.__call__ (and its hooks) now runs the tiled forward.
            module.forward = _tiled_forward.__get__(module)  # type: ignore[method-assign]
        else:
            state.num_shards = num_shards
        tiled += 1
    if tiled == 0:
        moe = f"; skipped {len(skipped_moe)} routed MoE block(s) ({skipped_moe[:3]}...)" if skipped_moe else ""
        raise ValueError(
            f"found no dense decoder MLP in {type(model).__name__}: expected modules named 'mlp' with children "
            f"{list(DENSE_MLP_CHILDREN)} (Llama/Mistral/Qwen2/Qwen3 style){moe}. Tiled MLP does not support "
            "routed experts."
        )
    return tiled
