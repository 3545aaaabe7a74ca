"""Several LoRA tenants' ``forward`` / ``forward_backward`` requests as one forward (and one backward) over the
shared base weights, each row through its own tenant's adapters.

The batch runs on a module tree of its own that shares the base parameters (`ModelRegistry.shared_tree`) and has
no adapters. A forward hook on each of its Linears adds, for each tenant's rows, that tenant's LoRA term
``scaling * B(A(x_rows))`` computed from the tenant's own ``lora_A`` / ``lora_B`` weights, so the adapter
gradients land in each tenant's own parameters. The tenants' adapters of one Linear run as two matmuls over the
whole batch (`_stacked_delta`: A's stacked along the rank, a per-row mask keeps each row's own tenant's columns),
so tenants with different ranks or different target modules batch together with no grouping by rank and no
padding of ranks, and the number of ops does not grow with the number of tenants. (Adapters with dropout, drawn
per tenant, take one small matmul pair per tenant instead.) The base projections, attention, the LM head and
the log-softmax run once for the batch.

Rows never mix in a transformer (no op reduces across the batch dim), and a tenant's loss depends only on its
rows, so the backward of the sum of the tenants' losses gives each adapter exactly the gradient of its own loss,
as when the tenant runs alone (up to float rounding of larger matmuls). A tenant whose loss fails (bad loss
config) gets its error; the others' losses are still backpropagated.

Legend: R = rows of the batch (all tenants' datums), S = padded length, I / O = a Linear's input / output features,
K = the batch's tenants' LoRA ranks summed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardforge.algorithms.serve.codecs import FwdBwdRequest
from shardforge.algorithms.serve.models import ModelRegistry, TrainingModel
from shardforge.algorithms.serve.training import encode_result, request_loss, target_logprobs
from shardforge.lora import LoRALinear

__all__ = ["LoRABatcher"]


@dataclass(frozen=True, slots=True)
class _Rows:
    """Rows ``start:stop`` of the batch use ``adapters`` (adapted Linear names -> that tenant's LoRALinear)."""

    start: int
    stop: int
    adapters: dict[str, LoRALinear]


def _stacked_delta(x_RSI: torch.Tensor, plan: list[_Rows], loras: list[LoRALinear | None]) -> torch.Tensor:
    """Every tenant's LoRA term in two matmuls: the tenants' A stacked ([K, I], K = the sum of their ranks), the
    rows' activations through all of them, each row's columns other than its tenant's zeroed (and its own scaled),
    then through the tenants' B stacked ([O, K]). Zeroed columns contribute exact zeros, so each row (and, in the
    backward, each tenant's A and B) gets only its own tenant's term."""
    a_KI = torch.cat([lora.lora_A.weight for lora in loras if lora is not None])
    b_OK = torch.cat([lora.lora_B.weight for lora in loras if lora is not None], dim=1)
    scale_RK = x_RSI.new_zeros((x_RSI.shape[0], a_KI.shape[0]))
    column = 0
    for rows, lora in zip(plan, loras, strict=True):
        if lora is not None:
            rank = lora.lora_A.weight.shape[0]
            scale_RK[rows.start : rows.stop, column : column + rank] = lora.lora_scaling
            column += rank
    return F.linear(F.linear(x_RSI, a_KI) * scale_RK[:, None, :], b_OK)


def _per_tenant_delta(
    x_RSI: torch.Tensor, plan: list[_Rows], loras: list[LoRALinear | None], out_RSO: torch.Tensor
) -> torch.Tensor:
    """The LoRA term tenant by tenant (for adapters with dropout, which is drawn per tenant)."""
    parts = []
    # one split (its backward is one cat), not a slice per tenant (each slice's backward writes a zero-filled
    # gradient of the whole input)
    for rows, lora, x in zip(plan, loras, x_RSI.split([rows.stop - rows.start for rows in plan]), strict=True):
        if lora is None:  # this tenant does not adapt this Linear
            parts.append(out_RSO.new_zeros((rows.stop - rows.start, *out_RSO.shape[1:])))
        else:
            parts.append(lora.lora_B(lora.lora_A(lora.lora_dropout(x))) * lora.lora_scaling)
    return torch.cat(parts)


class _BatchTree:
    """A module tree sharing the base parameters, whose Linears add the adapters of the running batch's rows."""

    def __init__(self, tree: nn.Module) -> None:
        self.tree = tree
        self.plan: list[_Rows] | None = None
        for name, module in tree.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        def add_adapters(module: nn.Module, args: tuple[torch.Tensor, ...], out_RSO: torch.Tensor) -> torch.Tensor:
            plan = self.plan
            if plan is None:
                return out_RSO
            loras = [rows.adapters.get(name) for rows in plan]
            present = [lora for lora in loras if lora is not None]
            if not present:
                return out_RSO
            if all(isinstance(lora.lora_dropout, nn.Identity) for lora in present):
                return out_RSO + _stacked_delta(args[0], plan, loras)
            return out_RSO + _per_tenant_delta(args[0], plan, loras, out_RSO)

        return add_adapters


class LoRABatcher:
    """Runs batches of ``(model, request)`` items of LoRA training models on ``registry``'s base model.

    Batches may run at once (the queue's workers): each takes a `_BatchTree` of its own from a pool (made on
    demand, at most one per concurrent batch; a tree costs module objects, no weights).
    """

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry
        self._free: list[_BatchTree] = []
        self._lock = threading.Lock()

    def _take_tree(self) -> _BatchTree:
        with self._lock:
            if self._free:
                return self._free.pop()
            return _BatchTree(self._registry.shared_tree())

    def _give_back(self, tree: _BatchTree) -> None:
        with self._lock:
            self._free.append(tree)

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
            plan.append(_Rows(start, start + len(request.data), model.adapters))
            start += len(request.data)
        train = not forward_only.pop()
        batch_tree = self._take_tree()
        try:
            with torch.set_grad_enabled(train):
                batch_tree.plan = plan
                try:
                    datums = [datum for _, request in items for datum in request.data]
                    logprobs_T = target_logprobs(batch_tree.tree, datums)
                finally:
                    batch_tree.plan = None
                return LoRABatcher._losses(items, logprobs_T, train)
        finally:
            self._give_back(batch_tree)

    @staticmethod
    def _losses(
        items: Sequence[tuple[TrainingModel, FwdBwdRequest]], logprobs_T: torch.Tensor, train: bool
    ) -> list[bytes | Exception]:
        """Each item's loss on its rows, one backward of their sum; the items' outputs or errors."""
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
            params += model.trainable
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
