"""What the queued training requests do: ``forward_backward`` / ``forward`` with a built-in loss, and
``optim_step`` with the Adam parameters of the call (gradients accumulate over ``forward_backward`` calls
until the next ``optim_step``, as in Tinker).

Legend: B = datums, S = padded length, V = vocabulary, T = the datums' tokens packed end to end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardforge.algorithms.serve.codecs import FwdBwdRequest, WireDatum, encode_packed_forward_backward_output
from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.losses import OPTIONAL_INPUTS, SERVE_LOSSES, LossResult, required_inputs
from shardforge.algorithms.serve.models import TrainingModel

__all__ = [
    "check_adam", "check_datums", "encode_result", "forward_backward", "optim_step", "request_loss", "target_logprobs",
]  # fmt: skip

_ADAM_KEYS = {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm", "type"}


def check_datums(
    data: Sequence[WireDatum], loss_fn: str, *, vocab_size: int, max_context: int | None, max_tokens: int
) -> None:
    """UserError naming the first datum that cannot be trained on, and why."""
    if loss_fn not in SERVE_LOSSES:  # never `SERVE_LOSSES.get` an unknown name: it would import a path
        raise UserError(f"loss_fn {loss_fn!r} is not supported; supported: {SERVE_LOSSES.names()}")
    if not data:
        raise UserError("forward_backward needs at least one datum")
    total = sum(len(d.tokens) for d in data)
    if total > max_tokens:
        raise UserError(f"the request holds {total} tokens; the limit is {max_tokens} per request (--max-batch-tokens)")
    names = (*required_inputs(loss_fn), *OPTIONAL_INPUTS.get(loss_fn, ()))
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        if n == 0:
            raise UserError(f"datum {i}: model_input is empty")
        if max_context is not None and n > max_context:
            raise UserError(f"datum {i}: {n} tokens exceed the model's context of {max_context}")
        if min(datum.tokens) < 0 or max(datum.tokens) >= vocab_size:
            raise UserError(f"datum {i}: model_input has token ids outside [0, {vocab_size})")
        for name in names:
            value = datum.inputs.get(name)
            if value is None and name in required_inputs(loss_fn):
                raise UserError(
                    f"datum {i}: loss {loss_fn!r} needs loss_fn_inputs[{name!r}]; got {sorted(datum.inputs)}"
                )
            if value is not None and value.shape != (n,):
                raise UserError(f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(value.shape)}; expected [{n}]")
    # the target ids' range over the whole request in one op; the failing datum is looked up only on failure
    targets = [datum.inputs["target_tokens"] for datum in data]
    floating = any(t.is_floating_point() for t in targets)
    if floating or not _in_range(torch.cat(targets), vocab_size):
        bad = next(i for i, t in enumerate(targets) if t.is_floating_point() or not _in_range(t, vocab_size))
        raise UserError(f"datum {bad}: target_tokens must be int64 ids in [0, {vocab_size})")


def _in_range(ids: torch.Tensor, vocab_size: int) -> bool:
    return bool(ids.min() >= 0) and bool(ids.max() < vocab_size)


def target_logprobs(module: torch.nn.Module, data: Sequence[WireDatum]) -> torch.Tensor:
    """[T] log pi(target_t | tokens_<=t) of every datum, packed (right padding, masked)."""
    lengths = [len(d.tokens) for d in data]
    width = max(lengths)
    # one tensor for all rows (not one per datum): right padding, mask from the lengths
    input_ids_BS = torch.tensor([d.tokens + [0] * (width - n) for d, n in zip(data, lengths, strict=True)])
    mask_BS = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    targets_BS = torch.zeros(len(data), width, dtype=torch.long)
    targets_BS[mask_BS.bool()] = torch.cat([d.inputs["target_tokens"].long() for d in data])
    device = next(module.parameters()).device
    logits_BSV = module(input_ids=input_ids_BS.to(device), attention_mask=mask_BS.to(device)).logits.float()
    logprobs_BS = F.log_softmax(logits_BSV, dim=-1).gather(-1, targets_BS.to(device)[..., None])[..., 0]
    return logprobs_BS[mask_BS.to(device).bool()]


def forward_backward(model: TrainingModel, request: FwdBwdRequest) -> bytes:
    """Run the loss (and its backward unless ``forward_only``); the ForwardBackwardOutput protobuf."""
    with torch.set_grad_enabled(not request.forward_only):
        logprobs_T = target_logprobs(model.module, request.data)
        result = request_loss(request, logprobs_T)
        if not request.forward_only:
            result.loss.backward()
    return encode_result(request, logprobs_T, result)


def request_loss(request: FwdBwdRequest, logprobs_T: torch.Tensor) -> LossResult:
    """The request's loss over its datums' target log-probs ``logprobs_T`` (packed in datum order)."""
    data = request.data
    optional = [n for n in OPTIONAL_INPUTS.get(request.loss_fn, ()) if all(n in d.inputs for d in data)]
    names = [*required_inputs(request.loss_fn), *optional]
    inputs = {name: torch.cat([d.inputs[name] for d in data]).to(logprobs_T.device) for name in names}
    lengths = [len(d.tokens) for d in data]
    return SERVE_LOSSES.get(request.loss_fn)(logprobs_T, inputs, lengths, request.loss_fn_config)


def encode_result(request: FwdBwdRequest, logprobs_T: torch.Tensor, result: LossResult) -> bytes:
    """The ForwardBackwardOutput protobuf: per datum its log-probs and loss terms, and the summed loss."""
    lengths = [len(d.tokens) for d in request.data]
    fields = {"logprobs": logprobs_T, "elementwise_loss": result.elementwise}
    return encode_packed_forward_backward_output(fields, lengths, {"loss:sum": float(result.loss.detach())})


def check_adam(adam: dict[str, Any]) -> None:
    """UserError unless ``adam`` is a valid AdamParams JSON object."""
    unknown = sorted(set(adam) - _ADAM_KEYS)
    if unknown or adam.get("type", "adamw") not in ("adamw", "adam"):
        raise UserError(
            f"adam_params: unsupported keys {unknown} or type {adam.get('type')!r}; valid: {sorted(_ADAM_KEYS)}"
        )
    lr, eps = float(adam.get("learning_rate", 1e-4)), float(adam.get("eps", 1e-12))
    betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
    if lr < 0 or eps < 0 or not all(0 <= b < 1 for b in betas):
        raise UserError(f"adam_params: learning_rate={lr} and eps={eps} must be >= 0, beta1, beta2={betas} in [0, 1)")


def optim_step(model: TrainingModel, adam: dict[str, Any]) -> dict[str, Any]:
    """One AdamW step with ``adam``'s hyper-parameters (Tinker's AdamParams, checked by `check_adam`), then zero
    the gradients."""
    lr, clip = float(adam.get("learning_rate", 1e-4)), float(adam.get("grad_clip_norm", 0.0))
    betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
    params = [p for p in model.trainable if p.grad is not None]
    # one foreach norm over all gradients (not one op per tensor), reused by the clipping
    grads = [grad for p in params if (grad := p.grad) is not None]
    if any(isinstance(grad, DTensor) for grad in grads):  # FSDP shards (full fine-tuning on several ranks)
        from shardforge.fsdp_wrap import clip_grad_norm_

        norm: torch.Tensor | None = clip_grad_norm_(params, clip if clip > 0 else math.inf)  # over all shards
    else:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else None
        if clip > 0 and norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
    for group in model.optimizer.param_groups:
        group.update(
            lr=lr, betas=betas, eps=float(adam.get("eps", 1e-12)), weight_decay=float(adam.get("weight_decay", 0.0))
        )
    model.optimizer.step()
    model.optimizer.zero_grad(set_to_none=True)
    model.steps += 1
    return {"metrics": {"grad_norm:mean": float(norm) if norm is not None else 0.0, "step:max": float(model.steps)}}
