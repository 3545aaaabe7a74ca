"""How one ``forward`` / ``forward_backward`` job runs over the ranks of `shardforge serve --nproc-per-node N`
(`serve.ranks` runs it on every rank).

The datums of the job (of one or several LoRA tenants) are split into contiguous chunks, one per data-parallel
rank; each rank runs its rows through the sharded base with each row's tenant's adapters (the forward hooks of
`serve.batching`), computes each tenant's loss on its own rows and backpropagates. Tinker's losses are sums over
tokens, so the sum of the ranks' losses is the 1-rank loss, and summing each adapter's gradient over the ranks (at
``optim_step``, `serve.ranks`) gives the 1-rank gradient. A rank without rows (fewer datums than ranks) runs the
first datum with weight 0: FSDP needs every rank in every forward and backward. A loss that fails on any rank fails
for all (the ranks agree before the backward), and that tenant's gradients are left as they were, as on one rank.

Legend: R = rows, S = padded length, O = a Linear's output features, T = the rank's rows' tokens packed end to end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.algorithms.serve.batching import _BatchTree
from shardforge.algorithms.serve.codecs import FwdBwdRequest, WireDatum
from shardforge.algorithms.serve.losses import LossResult
from shardforge.algorithms.serve.models import TrainingModel
from shardforge.algorithms.serve.training import encode_result, request_loss

__all__ = [
    "LocalItem", "RankBatchTree", "agreed_losses", "backward", "encode_outcomes", "gather_outcomes", "split_rows",
    "token_slice",
]  # fmt: skip

_FAILED_ELSEWHERE = "the loss failed on another rank"
"""A request's error on a rank that has none of its datums (the ranks that have some send the message)."""


class RankBatchTree(_BatchTree):
    """`serve.batching`'s adapter hooks, with a plain path for a job of one request (the usual case): its adapters
    over every row, as `LoRALinear.forward` computes them, without the stacking and row masks of a batch."""

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        batched = super()._hook(name)

        def add_adapters(module: nn.Module, args: tuple[torch.Tensor, ...], out_RSO: torch.Tensor) -> torch.Tensor:
            plan = self.plan
            if plan is None or len(plan) != 1:
                return batched(module, args, out_RSO)
            lora = plan[0].adapters.get(name)
            if lora is None:
                return out_RSO
            return out_RSO + lora.lora_B(lora.lora_A(lora.lora_dropout(args[0]))) * lora.lora_scaling

        return add_adapters


@dataclass(frozen=True, slots=True, eq=False)
class LocalItem:
    """One rank's share of one tenant's request: its datums and where their rows start in the rank's batch."""

    model: TrainingModel
    request: FwdBwdRequest
    data: list[WireDatum]
    """This rank's datums of the request (its loss runs on them)."""
    start: int
    """The first of its rows in the rank's batch."""
    rows: int
    """Its rows in the rank's batch: ``len(data)``, or 1 for the weight-0 row of a rank without datums."""


def split_rows(
    items: list[tuple[TrainingModel, FwdBwdRequest]], ranks: int, me: int
) -> tuple[list[LocalItem], list[WireDatum]]:
    """Data-parallel rank ``me`` of ``ranks``: its contiguous chunk of the jobs' datums (every request keeps an
    entry, maybe empty), and the datums its batch runs."""
    rows = [(i, datum) for i, (_, request) in enumerate(items) for datum in request.data]
    lo, hi = len(rows) * me // ranks, len(rows) * (me + 1) // ranks
    mine = rows[lo:hi]
    local, start = [], 0
    for i, (model, request) in enumerate(items):
        data = [datum for owner, datum in mine if owner == i]
        local.append(LocalItem(model, request, data, start, len(data)))
        start += len(data)
    datums = [datum for _, datum in mine]
    if not datums:  # no rows here: the first datum, weight 0 (it must still run the model's collectives)
        datums = [items[0][1].data[0]]
        local[0] = dataclasses.replace(local[0], rows=1)
        local[1:] = [dataclasses.replace(item, start=1) for item in local[1:]]
    return local, datums


def agreed_losses(
    local: list[LocalItem], logprobs_T: torch.Tensor, control: dist.ProcessGroup
) -> tuple[list[LossResult | None], list[str | None]]:
    """Each request's loss on this rank's rows; the errors agreed over the ranks (a loss that failed anywhere
    failed for all)."""
    results: list[LossResult | None] = []
    errors: list[str | None] = []
    for i, item in enumerate(local):
        if not item.data:
            results.append(None)
            errors.append(None)
            continue
        rows = logprobs_T[token_slice(local, i)]
        try:
            results.append(request_loss(dataclasses.replace(item.request, data=item.data), rows))
            errors.append(None)
        except Exception as exc:  # this tenant's loss only
            results.append(None)
            errors.append(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
    # One small all-reduce decides which requests failed anywhere; the messages travel with the results.
    failed = torch.tensor([float(error is not None) for error in errors])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=control)
    agreed = [error or (_FAILED_ELSEWHERE if flag > 0 else None) for error, flag in zip(errors, failed, strict=True)]
    return results, agreed


def backward(
    local: list[LocalItem],
    results: list[LossResult | None],
    errors: list[str | None],
    logprobs_T: torch.Tensor,
) -> None:
    """One backward on every rank into every request's adapters; the failed requests' gradients restored."""
    params = [p for item in local for p in item.model.module.parameters() if p.requires_grad]
    failed = [p for item, error in zip(local, errors, strict=True) if error is not None
              for p in item.model.module.parameters() if p.requires_grad]  # fmt: skip
    saved = [(p, None if p.grad is None else p.grad.clone()) for p in failed]
    # The 0-weighted sum over all rows keeps the graph the same on every rank (the same FSDP collectives in the
    # backward), whichever requests have rows here and whichever failed.
    total = logprobs_T.sum() * 0.0
    for result, error in zip(results, errors, strict=True):
        if result is not None and error is None:
            total = total + result.loss
    torch.autograd.backward(total, inputs=params)
    for param, grad in saved:
        param.grad = grad


def gather_outcomes(
    local: list[LocalItem],
    logprobs_T: torch.Tensor,
    results: list[LossResult | None],
    errors: list[str | None],
    control: dist.ProcessGroup,
    *,
    counted: bool = True,
) -> list[tuple[torch.Tensor, LossResult] | str] | None:
    """Rank 0: each request's log-probs, per-token losses and loss summed over the ranks, in datum order.
    ``counted`` False: this rank's rows are another rank's too (a tensor-parallel rank other than the first); it
    sends its errors only."""
    mine = []
    for i, (item, result, error) in enumerate(zip(local, results, errors, strict=True)):
        lp = logprobs_T[token_slice(local, i)].detach().float().cpu() if item.data and counted else torch.zeros(0)
        if result is None or error is not None or not counted:
            mine.append((lp, torch.zeros(0), 0.0, error))
        else:
            mine.append((lp, result.elementwise.float().cpu(), float(result.loss.detach()), None))
    rank = dist.get_rank()
    every: list[Any] = [None] * dist.get_world_size(control) if rank == 0 else []
    dist.gather_object(mine, every if rank == 0 else None, dst=0, group=control)
    if rank != 0:
        return None
    out: list[tuple[torch.Tensor, LossResult] | str] = []
    for i, error in enumerate(errors):
        parts = [rank_parts[i] for rank_parts in every]
        if error is not None:  # the first rank's own message (a rank without its rows only knows it failed)
            out.append(next((part[3] for part in parts if part[3] != _FAILED_ELSEWHERE), error))
            continue
        loss = torch.tensor(sum(part[2] for part in parts))
        elementwise = torch.cat([part[1] for part in parts])
        out.append((torch.cat([part[0] for part in parts]), LossResult(loss=loss, elementwise=elementwise)))
    return out


def encode_outcomes(
    requests: Sequence[FwdBwdRequest], outcomes: Sequence[tuple[torch.Tensor, LossResult] | str]
) -> list[bytes | Exception]:
    """Rank 0: the ForwardBackwardOutput protobuf of each request, or its loss's error."""
    from shardforge.algorithms.serve.futures import UserError

    return [
        UserError(outcome) if isinstance(outcome, str) else encode_result(request, *outcome)
        for request, outcome in zip(requests, outcomes, strict=True)
    ]


def token_slice(local: list[LocalItem], index: int) -> slice:
    """The tokens of ``item``'s datums in the rank's packed log-probs (a rank with datums has no weight-0 row)."""
    start = sum(len(d.tokens) for other in local[:index] for d in other.data)
    return slice(start, start + sum(len(d.tokens) for d in local[index].data))
