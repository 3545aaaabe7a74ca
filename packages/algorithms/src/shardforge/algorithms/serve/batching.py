"""Several LoRA tenants' ``forward`` / ``forward_backward`` requests as one forward (and one backward) over the
shared base weights, each row through its own tenant's adapters.

The batch runs on a module tree of its own that shares the base parameters (`ModelRegistry.shared_tree`) and has
no adapters. A forward hook on each of its Linears adds, for each tenant's rows, that tenant's LoRA term
``scaling * B(A(dropout(x_rows)))`` computed with the tenant's own ``lora_A`` / ``lora_B`` modules (the same
operation order as `shardforge.lora.LoRALinear`), so the adapter gradients land in each tenant's own parameters.
Tenants with different ranks or different target modules batch together: each tenant's rows get their own small
matmuls (no grouping by rank, no padding of ranks); what is batched is everything else: the base projections,
attention, the LM head and the log-softmax, which is where the time goes.

Rows never mix in a transformer (no op reduces across the batch dim), and a tenant's loss depends only on its
rows, so the backward of the sum of the tenants' losses gives each adapter exactly the gradient of its own loss,
as when the tenant runs alone (up to float rounding of larger matmuls). A tenant whose loss fails (bad loss
config) gets its error; the others' losses are still backpropagated.

Legend: R = rows of the batch (all tenants' datums), S = padded length, O = a Linear's output features.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardforge.algorithms.serve.codecs import FwdBwdRequest
from shardforge.algorithms.serve.models import ModelRegistry, TrainingModel
from shardforge.algorithms.serve.training import encode_result, request_loss, target_logprobs
from shardforge.lora import LoRALinear, lora_modules

__all__ = ["LoRABatcher"]


@dataclass(frozen=True, slots=True)
class _Rows:
    """Rows ``start:stop`` of the batch use ``adapters`` (adapted Linear names -> that tenant's LoRALinear)."""

    start: int
    stop: int
    adapters: dict[str, LoRALinear]


class LoRABatcher:
    """Runs batches of ``(model, request)`` items of LoRA training models on ``registry``'s base model.

    One batch at a time (a lock): the tree's hooks read the running batch's row plan.
    """

    def __init__(self, registry: ModelRegistry) -> None:
        self._tree = registry.shared_tree()
        self._plan: list[_Rows] | None = None
        self._lock = threading.Lock()
        for name, module in self._tree.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        def add_adapters(module: nn.Module, args: tuple[torch.Tensor, ...], out_RSO: torch.Tensor) -> torch.Tensor:
            plan = self._plan
            if plan is None or not any(name in rows.adapters for rows in plan):
                return out_RSO
            x = args[0]
            parts = []
            for rows in plan:
                lora = rows.adapters.get(name)
                if lora is None:  # this tenant does not adapt this Linear
                    parts.append(out_RSO.new_zeros((rows.stop - rows.start, *out_RSO.shape[1:])))
                else:
                    part = x[rows.start : rows.stop]
                    parts.append(lora.lora_B(lora.lora_A(lora.lora_dropout(part))) * lora.lora_scaling)
            return out_RSO + torch.cat(parts)

        return add_adapters

    def run(self, items: Sequence[tuple[TrainingModel, FwdBwdRequest]]) -> list[bytes | Exception]:
        """Each item's ForwardBackwardOutput protobuf, or the exception its loss failed with.

        Raises (before any gradient is written) when the batch cannot run at all: the caller then runs each item
        alone. All items must agree on ``forward_only``.
        """
        forward_only = {request.forward_only for _, request in items}
        if len(forward_only) != 1:
            raise ValueError("a batch mixes forward and forward_backward requests")
        if any(model.lora is None for model, _ in items):
            raise ValueError("only LoRA training models batch (a full fine-tuning model has weights of its own)")
        plan, start = [], 0
        for model, request in items:
            plan.append(_Rows(start, start + len(request.data), dict(lora_modules(model.module))))
            start += len(request.data)
        train = not forward_only.pop()
        with self._lock, torch.set_grad_enabled(train):
            self._plan = plan
            try:
                logprobs_T = target_logprobs(self._tree, [datum for _, request in items for datum in request.data])
            finally:
                self._plan = None
            tokens = [sum(len(datum.tokens) for datum in request.data) for _, request in items]
            outcomes: list[tuple[torch.Tensor, object] | Exception] = []
            losses, params = [], []
            for (model, request), logprobs in zip(items, logprobs_T.split(tokens), strict=True):
                try:
                    result = request_loss(request, logprobs)
                except Exception as exc:  # this tenant's loss only: the others still train
                    outcomes.append(exc)
                    continue
                outcomes.append((logprobs, result))
                losses.append(result.loss)
                params += [p for p in model.module.parameters() if p.requires_grad]
            if train and losses:
                try:
                    # only into the adapters of tenants whose loss ran: a failed tenant's adapters are in the graph
                    # too (its rows share the batch's tensors) and would get zero gradients instead of none
                    torch.autograd.backward(torch.stack(losses).sum(), inputs=params)
                except Exception as exc:  # gradients may be partly written: fail the batch, never rerun it
                    return [RuntimeError(f"the batched backward failed: {exc}") for _ in items]
        return [
            outcome if isinstance(outcome, Exception) else encode_result(request, *outcome)  # type: ignore[arg-type]
            for (_, request), outcome in zip(items, outcomes, strict=True)
        ]
