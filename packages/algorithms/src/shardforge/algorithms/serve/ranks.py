"""Every rank's part of `shardforge serve --nproc-per-node N` (N > 1): the base model sharded with the engine's
FSDP/HSDP (`shardforge.engine.build.build_model`, the trainers' composition order), each LoRA training model's
adapters and AdamW replicated on every rank, and the jobs rank 0 sends (`RankJob`) run by all ranks together.

How a job runs: rank 0 broadcasts a `RankJob` (its op and plain arguments: model ids, the request's datums)
over a gloo control group, then every rank runs the same method of `RankRuntime`. Rank 0 is also a rank: it runs
the job like the others and assembles the answer. Jobs run one at a time (rank 0 holds a lock around each), so
every rank issues the same collectives in the same order.

forward(_backward): the datums of the job (of one or several LoRA tenants) are split into contiguous chunks, one
per data-parallel rank; each rank runs its rows through the sharded base with each row's tenant's adapters (the
forward hooks of `serve.batching`), computes each tenant's loss on its own rows and backpropagates. Tinker's losses
are sums over tokens, so the sum of the ranks' losses is the 1-rank loss, and summing each adapter's gradient
over the ranks (at ``optim_step``, one all-reduce of all of a model's gradients) gives the 1-rank gradient. A rank
without rows (fewer datums than ranks) runs the first datum with weight 0: FSDP needs every rank in every forward
and backward. A loss that fails on any rank fails for all (the ranks agree before the backward), and that tenant's
gradients are left as they were, as on one rank.

Legend: T = the rank's rows' tokens packed end to end.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.algorithms.serve.batching import _BatchTree, _Rows
from shardforge.algorithms.serve.codecs import FwdBwdRequest, WireDatum
from shardforge.algorithms.serve.losses import LossResult
from shardforge.algorithms.serve.models import TrainingModel, adapter_optimizer
from shardforge.algorithms.serve.training import encode_result, request_loss, target_logprobs
from shardforge.core.log import get_logger
from shardforge.lora import LoRAConfig
from shardforge.mesh import ParallelDims

__all__ = ["RankJob", "RankRuntime", "check_serve_layout", "follow"]

log = get_logger(__name__)

_IDLE_TIMEOUT = datetime.timedelta(days=365)
"""The control group's timeout: followers wait for the next job as long as the service is idle. A dead rank does
not leave the others waiting: the launcher's torchrun agent stops every rank when one exits."""

_FAILED_ELSEWHERE = "the loss failed on another rank"
"""A request's error on a rank that has none of its datums (the ranks that have some send the message)."""


def check_serve_layout(layout: str, world_size: int) -> ParallelDims:
    """The resolved layout of ``--layout`` on ``world_size`` ranks; ValueError unless it only shards (d) and
    replicates (r) the base."""
    dims = ParallelDims.parse(layout).resolve(world_size)
    others = {"tp": dims.tp, "cp": dims.cp, "pp": dims.pp, "ep": dims.ep}
    if any(size > 1 for size in others.values()):
        raise ValueError(
            f"--layout {layout!r} has {', '.join(f'{k}={v}' for k, v in others.items() if v > 1)}; shardforge serve "
            f"shards the base with FSDP (d) and HSDP (r, d) only, e.g. d{world_size} or r2d{max(world_size // 2, 1)}"
        )
    return dims


class _RankBatchTree(_BatchTree):
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


@dataclass(frozen=True, slots=True)
class RankJob:
    """What rank 0 broadcasts: a `RankRuntime` method name and its (picklable) arguments."""

    op: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class _LocalItem:
    """One rank's share of one tenant's request: its datums and where their rows start in the rank's batch."""

    model: TrainingModel
    request: FwdBwdRequest
    data: list[WireDatum]
    """This rank's datums of the request (its loss runs on them)."""
    start: int
    """The first of its rows in the rank's batch."""
    rows: int
    """Its rows in the rank's batch: ``len(data)``, or 1 for the weight-0 row of a rank without datums."""


class RankRuntime:
    """One rank's sharded base and replicated adapters (see the module doc). Collective: every rank builds one.

    Args:
        model_dir: the HF base model directory.
        layout: ``--layout`` (FSDP/HSDP letters only, `check_serve_layout`).
        models: rank 0 passes its registry's training models (the adapters it trains are its own); the other
            ranks start empty and create theirs when rank 0 says.
        timeout_s: collective timeout inside a job.
    """

    def __init__(
        self, model_dir: str, layout: str, *, models: dict[str, TrainingModel] | None = None, timeout_s: float = 600.0
    ) -> None:
        from shardforge.engine import EngineConfig
        from shardforge.engine.build import build_model
        from shardforge.engine.context import ParallelContext
        from shardforge.engine.heads import make_head
        from shardforge.engine.loading import load_hf_config
        from shardforge.mesh import build_mesh, current_device, init_distributed

        init_distributed(timeout_s=timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dims = check_serve_layout(layout, self.world)
        config = EngineConfig(dist_timeout_s=timeout_s)
        mesh = build_mesh(self.dims)
        self.ctx = ParallelContext(dims=self.dims, mesh=mesh, device=current_device(), config=config)
        head = make_head("lm")
        hf_config = head.hf_config(load_hf_config(model_dir))
        self.base, _ = build_model(self.ctx, head, hf_config, model_dir)
        self.base.eval()
        for param in self.base.parameters():
            param.requires_grad_(False)
        self._batch = _RankBatchTree(self.base)
        with torch.device("meta"):  # the followers' adapters are made on a weightless copy of the module tree
            from transformers import AutoModelForCausalLM

            self._skeleton = AutoModelForCausalLM.from_config(load_hf_config(model_dir))
        self.control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        self.models: dict[str, TrainingModel] = {} if models is None else models

    # ------------------------------------------------------------------ the job channel
    def send(self, job: RankJob) -> None:
        """Rank 0: hand ``job`` to every other rank (they then run it with `execute`, as rank 0 does)."""
        dist.broadcast_object_list([job], src=0, group=self.control)

    def receive(self) -> RankJob:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]  # type: ignore[no-any-return]

    def execute(self, job: RankJob) -> Any:
        op: Callable[..., Any] = getattr(self, f"op_{job.op}")
        return op(*job.args)

    # ------------------------------------------------------------------ ops (every rank runs each one)
    def op_create(self, owner: str, model_id: str, lora: LoRAConfig, seed: int, base_model: str) -> None:
        """Rank 0 has made the model already (its registry); the others make the same adapters from ``seed``."""
        if self.rank == 0:
            model = self.models[model_id]
            for _, module in _lora_children(model.module):  # only the adapters: the host base stays where it is
                module.lora_A.to(self.ctx.device)  # in place: the optimizer keeps the same parameters
                module.lora_B.to(self.ctx.device)
        else:
            from shardforge.lora import apply_lora, reset_lora_parameters

            tree = copy.deepcopy(self._skeleton)
            apply_lora(tree, lora, seed=seed)  # meta adapters: shapes and names only
            for _, module in _lora_children(tree):  # the adapters get memory; the base Linears stay meta
                module.lora_A.to_empty(device=self.ctx.device)
                module.lora_B.to_empty(device=self.ctx.device)
            reset_lora_parameters(tree, lora, seed=seed)  # the values `apply_lora(seed=seed)` gave rank 0's
            params = [p for p in tree.parameters() if p.requires_grad]
            self.models[model_id] = TrainingModel(
                model_id=model_id, owner=owner, base_model=base_model, lora=lora, seed=seed, module=tree,
                optimizer=adapter_optimizer(params),
            )  # fmt: skip
        self.op_check_replicas(model_id)

    def op_load(self, root: str, model_id: str, request: dict[str, Any]) -> None:
        """Every rank reads the checkpoint rank 0 has just loaded (the same file: one machine's disk)."""
        if self.rank != 0:
            from shardforge.algorithms.serve.checkpoints import load_state

            load_state(Path(root), self.models[model_id], request)
        self.op_check_replicas(model_id)

    def op_check_replicas(self, model_id: str) -> None:
        """RuntimeError unless every rank holds the same adapters and optimizer state of ``model_id``."""
        digests: list[Any] = [None] * self.world
        dist.all_gather_object(digests, _digest(self.models[model_id]), group=self.control)
        if len(set(digests)) != 1:
            raise RuntimeError(f"the ranks' copies of {model_id} differ (digests {digests}): the replicas diverged")

    def op_forward_backward(
        self, jobs: Sequence[tuple[str, FwdBwdRequest]]
    ) -> list[tuple[torch.Tensor, LossResult] | str] | None:
        """Run the requests ``jobs`` (model id, request; all forward-only or all not) over the ranks. Rank 0 gets
        per request its (log-probs [T], loss) over all its datums, or the error its loss failed with; the others
        None."""
        train = not jobs[0][1].forward_only
        local, datums = self._split([(self.models[model_id], request) for model_id, request in jobs])
        plan = [_Rows(i.start, i.start + i.rows, dict(_lora_children(i.model.module))) for i in local]
        with torch.set_grad_enabled(train):
            self._batch.plan = plan
            try:
                logprobs_T = target_logprobs(self.base, datums)
            finally:
                self._batch.plan = None
            results, errors = self._losses(local, logprobs_T)
            if train and any(error is None for error in errors):
                self._backward(local, results, errors, logprobs_T)
        return self._gather(local, logprobs_T, results, errors)

    def op_optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, Any]:
        """Sum the ranks' gradients (one all-reduce), then the 1-rank AdamW step on every rank."""
        from shardforge.algorithms.serve.training import optim_step

        model = self.models[model_id]
        params = [p for group in model.optimizer.param_groups for p in group["params"]]
        has_grad = torch.tensor([float(any(p.grad is not None for p in params))], device=self.ctx.device)
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device) for p in params]
        flat = torch.cat([*grads, has_grad])
        dist.all_reduce(flat, group=self.ctx.dp_group)
        if flat[-1] > 0:  # some rank has gradients: every rank now holds their sum
            for param, grad in zip(params, flat[:-1].split([p.numel() for p in params]), strict=True):
                param.grad = grad.view_as(param).clone()
        return optim_step(model, adam)

    def op_drop(self, model_id: str) -> None:
        """Forget ``model_id`` (rank 0 failed to finish making it)."""
        if self.rank != 0:
            self.models.pop(model_id, None)

    # ------------------------------------------------------------------ forward_backward's parts
    def _split(self, items: list[tuple[TrainingModel, FwdBwdRequest]]) -> tuple[list[_LocalItem], list[WireDatum]]:
        """This rank's contiguous chunk of the jobs' datums (every request keeps an entry, maybe empty)."""
        rows = [(i, datum) for i, (_, request) in enumerate(items) for datum in request.data]
        ranks, me = self.ctx.dims.dp, self.ctx.dp_rank
        lo, hi = len(rows) * me // ranks, len(rows) * (me + 1) // ranks
        mine = rows[lo:hi]
        local, start = [], 0
        for i, (model, request) in enumerate(items):
            data = [datum for owner, datum in mine if owner == i]
            local.append(_LocalItem(model, request, data, start, len(data)))
            start += len(data)
        datums = [datum for _, datum in mine]
        if not datums:  # no rows here: the first datum, weight 0 (it must still run the model's collectives)
            datums = [items[0][1].data[0]]
            local[0] = dataclasses.replace(local[0], rows=1)
            local[1:] = [dataclasses.replace(item, start=1) for item in local[1:]]
        return local, datums

    def _losses(
        self, local: list[_LocalItem], logprobs_T: torch.Tensor
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
            rows = logprobs_T[_token_slice(local, i)]
            try:
                results.append(request_loss(dataclasses.replace(item.request, data=item.data), rows))
                errors.append(None)
            except Exception as exc:  # this tenant's loss only
                results.append(None)
                errors.append(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
        # One small all-reduce decides which requests failed anywhere; the messages travel with the results.
        failed = torch.tensor([float(error is not None) for error in errors])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.control)
        agreed = [
            error or (_FAILED_ELSEWHERE if flag > 0 else None) for error, flag in zip(errors, failed, strict=True)
        ]
        return results, agreed

    def _backward(
        self,
        local: list[_LocalItem],
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

    def _gather(
        self,
        local: list[_LocalItem],
        logprobs_T: torch.Tensor,
        results: list[LossResult | None],
        errors: list[str | None],
    ) -> list[tuple[torch.Tensor, LossResult] | str] | None:
        """Rank 0: each request's log-probs, per-token losses and loss summed over the ranks, in datum order."""
        mine = []
        for i, (item, result, error) in enumerate(zip(local, results, errors, strict=True)):
            lp = logprobs_T[_token_slice(local, i)].detach().float().cpu() if item.data else torch.zeros(0)
            if result is None or error is not None:
                mine.append((lp, torch.zeros(0), 0.0, error))
            else:
                mine.append((lp, result.elementwise.float().cpu(), float(result.loss.detach()), None))
        every: list[Any] = [None] * self.world if self.rank == 0 else []
        dist.gather_object(mine, every if self.rank == 0 else None, dst=0, group=self.control)
        if self.rank != 0:
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


def follow(runtime: RankRuntime) -> None:
    """Ranks 1..N-1: run rank 0's jobs until it says stop. An exception ends the rank (and, through the
    launcher's agent, the service): a rank that failed inside a job cannot rejoin its collectives."""
    while True:
        job = runtime.receive()
        if job.op == "stop":
            log.info("rank %d: rank 0 stopped the service", runtime.rank)
            return
        runtime.execute(job)


def _token_slice(local: list[_LocalItem], index: int) -> slice:
    """The tokens of ``item``'s datums in the rank's packed log-probs (a rank with datums has no weight-0 row)."""
    start = sum(len(d.tokens) for other in local[:index] for d in other.data)
    return slice(start, start + sum(len(d.tokens) for d in local[index].data))


def _lora_children(module: nn.Module) -> list[tuple[str, Any]]:
    from shardforge.lora import lora_modules

    return list(lora_modules(module))


def _digest(model: TrainingModel) -> str:
    """A hash of ``model``'s trained parameters and AdamW state (bit-exact)."""
    digest = hashlib.sha256()
    for name, value in sorted(model.adapter_state().items()):
        digest.update(name.encode())
        digest.update(value.float().numpy().tobytes())
    for state in model.optimizer.state.values():
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().float().cpu().numpy().tobytes())
    digest.update(str(model.steps).encode())
    return digest.hexdigest()[:16]
