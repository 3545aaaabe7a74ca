"""Every rank's part of `shardforge serve --nproc-per-node N` (N > 1): the base model sharded with the engine's
FSDP/HSDP and tensor parallelism (`shardforge.engine.build.build_model`, the trainers' composition order; TP:
`serve.tp_lora`), each LoRA training model's
adapters and AdamW replicated on every rank, and the jobs rank 0 sends (`RankJob`) run by all ranks together.

How a job runs: rank 0 broadcasts a `RankJob` (its op and plain arguments: model ids, the request's datums)
over a gloo control group, then every rank runs the same method of `RankRuntime`. Rank 0 is also a rank: it runs
the job like the others and assembles the answer. Jobs run one at a time (rank 0 holds a lock around each), so
every rank issues the same collectives in the same order.

forward(_backward) jobs: `serve.rank_batch`. Full fine-tuning (a sharded trainable copy per client): `serve.full_ranks`.

Legend: T = tokens of a job's datums packed end to end.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.algorithms.serve.batching import _Rows
from shardforge.algorithms.serve.codecs import FwdBwdRequest
from shardforge.algorithms.serve.full_ranks import FullModelRanks
from shardforge.algorithms.serve.losses import LossResult
from shardforge.algorithms.serve.models import TrainingModel, adapter_optimizer
from shardforge.algorithms.serve.rank_batch import (
    RankBatchTree,
    agreed_losses,
    backward,
    gather_outcomes,
    split_rows,
)
from shardforge.algorithms.serve.tp_lora import TPLoRATree, adapter_grad_group, check_tp_base
from shardforge.algorithms.serve.training import target_logprobs
from shardforge.core.log import get_logger
from shardforge.lora import LoRAConfig
from shardforge.mesh import ParallelDims

__all__ = ["RankJob", "RankRuntime", "check_serve_layout", "follow"]

log = get_logger(__name__)

_IDLE_TIMEOUT = datetime.timedelta(days=365)
"""The control group's timeout: followers wait for the next job as long as the service is idle. A dead rank does
not leave the others waiting: the launcher's torchrun agent stops every rank when one exits."""


def check_serve_layout(layout: str, world_size: int) -> ParallelDims:
    """The resolved layout of ``--layout`` on ``world_size`` ranks; ValueError unless it only shards (d),
    replicates (r) and tensor-parallelises (t) the base."""
    dims = ParallelDims.parse(layout).resolve(world_size)
    others = {"cp": dims.cp, "pp": dims.pp, "ep": dims.ep}
    if any(size > 1 for size in others.values()):
        raise ValueError(
            f"--layout {layout!r} has {', '.join(f'{k}={v}' for k, v in others.items() if v > 1)}; shardforge serve "
            f"shards the base with FSDP (d), HSDP (r, d) and tensor parallelism (t) only, e.g. d{world_size}, "
            f"r2d{max(world_size // 2, 1)}, t2 or d{max(world_size // 2, 1)}t2"
        )
    return dims


@dataclass(frozen=True, slots=True)
class RankJob:
    """What rank 0 broadcasts: a `RankRuntime` method name and its (picklable) arguments."""

    op: str
    args: tuple[Any, ...] = ()


class RankRuntime(FullModelRanks):
    """One rank's sharded base, replicated adapters and sharded full fine-tuning copies (see the module doc).
    Collective: every rank builds one.

    Args:
        model_dir: the HF base model directory.
        layout: ``--layout`` (d, r and t letters only, `check_serve_layout`).
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
        if self.dims.tp > 1:
            check_tp_base(load_hf_config(model_dir), self.dims.tp, sequence_parallel=config.sequence_parallel)
        mesh = build_mesh(self.dims)
        self.ctx = ParallelContext(dims=self.dims, mesh=mesh, device=current_device(), config=config)
        head = make_head("lm")
        hf_config = head.hf_config(load_hf_config(model_dir))
        self.base, _ = build_model(self.ctx, head, hf_config, model_dir)
        self._source = (head, hf_config, model_dir)  # a full fine-tuning copy is built as the base was
        self.base.eval()
        for param in self.base.parameters():
            param.requires_grad_(False)
        self._batch: RankBatchTree | TPLoRATree = (
            RankBatchTree(self.base) if self.dims.tp == 1 else TPLoRATree(self.base, tp=self.dims.tp)
        )
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
        items = [(self.models[model_id], request) for model_id, request in jobs]
        local, datums = split_rows(items, self.ctx.dims.dp, self.ctx.dp_rank)
        plan = [_Rows(i.start, i.start + i.rows, dict(_lora_children(i.model.module))) for i in local]
        with torch.set_grad_enabled(train):
            logprobs_T = self._logprobs(datums, plan)
            results, errors = agreed_losses(local, logprobs_T, self.control)
            if train and any(error is None for error in errors):
                backward(local, results, errors, logprobs_T)
        # the TP ranks of a data-parallel rank hold the same rows: only the first's count
        counted = self.ctx.local_rank("tp") == 0
        return gather_outcomes(local, logprobs_T, results, errors, self.control, counted=counted)

    def _logprobs(self, datums: list[Any], plan: list[_Rows]) -> torch.Tensor:
        if isinstance(self._batch, TPLoRATree):
            return self._batch.logprobs(datums, plan)
        self._batch.plan = plan
        try:
            return target_logprobs(self.base, datums)
        finally:
            self._batch.plan = None

    def op_optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, Any]:
        """Sum the ranks' gradients (one all-reduce; over the TP ranks too, `serve.tp_lora`), then the 1-rank AdamW
        step on every rank."""
        from shardforge.algorithms.serve.training import optim_step

        model = self.models[model_id]
        params = [p for group in model.optimizer.param_groups for p in group["params"]]
        has_grad = torch.tensor([float(any(p.grad is not None for p in params))], device=self.ctx.device)
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device) for p in params]
        flat = torch.cat([*grads, has_grad])
        dist.all_reduce(flat, group=adapter_grad_group(self.dims.tp, self.ctx.dp_group))
        if flat[-1] > 0:  # some rank has gradients: every rank now holds their sum
            for param, grad in zip(params, flat[:-1].split([p.numel() for p in params]), strict=True):
                param.grad = grad.view_as(param).clone()
        return optim_step(model, adam)


def follow(runtime: RankRuntime) -> None:
    """Ranks 1..N-1: run rank 0's jobs until it says stop. An exception ends the rank (and, through the
    launcher's agent, the service): a rank that failed inside a job cannot rejoin its collectives."""
    while True:
        job = runtime.receive()
        if job.op == "stop":
            log.info("rank %d: rank 0 stopped the service", runtime.rank)
            return
        runtime.execute(job)


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
