"""How the service's queued jobs touch the training models: `LocalOps` in one process (the default), or
`ShardedOps` on rank 0 of `shardforge serve --nproc-per-node N`, which runs each job on every rank together
(`serve.ranks`: the base sharded with the engine's FSDP, LoRA adapters replicated, full fine-tuning copies sharded
as the base is, `serve.full_ranks`).

Rank 0 alone still holds what needs no other rank: the HTTP app, the futures queue, tenants and keys, the
registry (with a full copy of the base weights in host memory, the source of sampling, ``save_weights_for_sampler``
and exports; a full fine-tuning model's weights are gathered to rank 0 for those), and the sampler, which generates
on rank 0 alone (docs/tinker.md).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch

from shardforge.algorithms.serve.batching import LoRABatcher
from shardforge.algorithms.serve.codecs import FwdBwdRequest
from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.models import ModelRegistry, TrainingModel
from shardforge.core.log import get_logger
from shardforge.lora import LoRAConfig

__all__ = ["LocalOps", "ModelOps", "OpsFactory", "ShardedOps", "sharded_ops"]

log = get_logger(__name__)


class ModelOps(Protocol):
    """What the queued jobs do to training models (each method but `check_lora` runs inside one job)."""

    def check_lora(self, lora: LoRAConfig | None) -> None:
        """UserError (a 400 before anything is queued) if a model of this kind cannot be trained here."""
        ...

    def create_model(
        self, owner: str, model_id: str, lora: LoRAConfig | None, seed: int | None, metadata: dict[str, str]
    ) -> TrainingModel: ...

    def forward_backward(self, model: TrainingModel, request: FwdBwdRequest) -> bytes: ...

    def run_batch(self, items: Sequence[tuple[TrainingModel, FwdBwdRequest]]) -> list[bytes | Exception]: ...

    def optim_step(self, model: TrainingModel, adam: dict[str, Any]) -> dict[str, Any]: ...

    def trained_weights(self, model: TrainingModel) -> dict[str, torch.Tensor]:
        """The model's trained weights, whole, on the CPU (sampler snapshots and exports)."""
        ...

    def save_state(self, root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]: ...

    def load_state(self, root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


OpsFactory = Callable[[ModelRegistry, LoRABatcher], ModelOps]
"""Builds a service's `ModelOps` from its registry and batcher."""


class LocalOps:
    """Everything in this process (`shardforge serve` with one rank)."""

    def __init__(self, registry: ModelRegistry, batcher: LoRABatcher) -> None:
        self._registry = registry
        self._batcher = batcher

    def check_lora(self, lora: LoRAConfig | None) -> None:
        pass

    def create_model(
        self, owner: str, model_id: str, lora: LoRAConfig | None, seed: int | None, metadata: dict[str, str]
    ) -> TrainingModel:
        return self._registry.create_model(owner, model_id, lora, seed, metadata)

    def forward_backward(self, model: TrainingModel, request: FwdBwdRequest) -> bytes:
        from shardforge.algorithms.serve.training import forward_backward

        return forward_backward(model, request)

    def run_batch(self, items: Sequence[tuple[TrainingModel, FwdBwdRequest]]) -> list[bytes | Exception]:
        return self._batcher.run(items)

    def optim_step(self, model: TrainingModel, adam: dict[str, Any]) -> dict[str, Any]:
        from shardforge.algorithms.serve.training import optim_step

        return optim_step(model, adam)

    def trained_weights(self, model: TrainingModel) -> dict[str, torch.Tensor]:
        return model.adapter_state()

    def save_state(self, root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]:
        from shardforge.algorithms.serve.checkpoints import save_state

        return save_state(root, model, request)

    def load_state(self, root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]:
        from shardforge.algorithms.serve.checkpoints import load_state

        return load_state(root, model, request)

    def close(self) -> None:
        pass


class ShardedOps:
    """Rank 0's side of a multi-rank service: each job is checked here, then sent to every rank and run by all
    (one job at a time); what only rank 0 holds (checkpoint files, the registry) it does alone.

    A failure inside a job that every rank runs (not a tenant's loss, which the ranks agree on and answer as that
    request's error) leaves the ranks' collectives out of step: rank 0 then ends the process, and the launcher's
    agent stops the other ranks, with the error as the service's last line.
    """

    def __init__(self, runtime: Any, registry: ModelRegistry, report: Callable[[str], bool] | None = None) -> None:
        self._runtime = runtime  # a `serve.ranks.RankRuntime` holding `registry.models`
        self._registry = registry
        self._report = report
        self._lock = threading.Lock()

    def _run(self, op: str, *args: Any) -> Any:
        from shardforge.algorithms.serve.ranks import RankJob

        job = RankJob(op, args)
        with self._lock:
            try:
                self._runtime.send(job)
                return self._runtime.execute(job)
            except BaseException as exc:  # the ranks are out of step: nothing can continue
                _fatal(op, exc, self._report)

    def check_lora(self, lora: LoRAConfig | None) -> None:
        """LoRA (adapters replicated) is served on every layout; full fine-tuning (a copy sharded as the base) on
        FSDP/HSDP layouts only: its forward runs padded rows, which the TP base (sequence parallel) cannot take."""
        tp = self._runtime.dims.tp
        if lora is None and tp > 1:
            raise UserError(
                f"full fine-tuning (no lora_config) is not served with a tensor-parallel layout (tp={tp}): serve with "
                "an FSDP/HSDP layout (d, r) for full fine-tuning clients, or create a LoRA training client"
            )

    def create_model(
        self, owner: str, model_id: str, lora: LoRAConfig | None, seed: int | None, metadata: dict[str, str]
    ) -> TrainingModel:
        if lora is None:  # every rank builds its shard first; the registry then holds rank 0's
            self._registry.check_new_id(model_id)
            module = self._run("full_create", owner, model_id, self._registry.base_model, seed or 0)
            return self._registry.create_model(owner, model_id, None, seed or 0, metadata, module=module)
        model = self._registry.create_model(owner, model_id, lora, seed, metadata)  # a repeated id fails here
        self._run("create", owner, model_id, lora, model.seed, model.base_model)
        return model

    def forward_backward(self, model: TrainingModel, request: FwdBwdRequest) -> bytes:
        outcome = self.run_batch([(model, request)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def run_batch(self, items: Sequence[tuple[TrainingModel, FwdBwdRequest]]) -> list[bytes | Exception]:
        from shardforge.algorithms.serve.rank_batch import encode_outcomes

        if len({request.forward_only for _, request in items}) != 1:
            raise ValueError("a batch mixes forward and forward_backward requests")
        if items[0][0].lora is None:  # full fine-tuning: never batched (`TinkerService.forward_backward`)
            if len(items) != 1:
                raise ValueError("a full fine-tuning model's requests run one at a time, not in a batch")
            model, request = items[0]
            outcomes = self._run("full_forward_backward", model.model_id, request)
            return encode_outcomes([request], outcomes)
        outcomes = self._run("forward_backward", [(model.model_id, request) for model, request in items])
        return encode_outcomes([request for _, request in items], outcomes)

    def optim_step(self, model: TrainingModel, adam: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._run("optim_step" if model.lora is not None else "full_optim_step",
                                           model.model_id, adam)  # fmt: skip
        return result

    def trained_weights(self, model: TrainingModel) -> dict[str, torch.Tensor]:
        if model.lora is not None:  # replicated: rank 0's own copy
            return model.adapter_state()
        weights: dict[str, torch.Tensor] = self._run("full_weights", model.model_id)
        return weights

    def save_state(self, root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]:
        from shardforge.algorithms.serve.checkpoints import save_state, save_target

        if model.lora is None:  # sharded: every rank writes its shards into one DCP checkpoint
            name, target = save_target(root, model, request)  # an existing name fails here, on rank 0 alone
            error = self._run("full_save", model.model_id, str(target))
            if error is not None:  # nothing was committed; the previous checkpoint of that name, if any, is whole
                raise RuntimeError(f"save_state {name!r} failed on the ranks, nothing was saved: {error}")
            return {"type": "save_weights", "path": f"tinker://{model.model_id}/weights/{name}"}
        # Adapters and AdamW state are replicated: rank 0 writes them, once the ranks agree they are identical
        # (a checkpoint therefore loads on any number of ranks).
        self._run("check_replicas", model.model_id)
        return save_state(root, model, request)

    def load_state(self, root: Path, model: TrainingModel, request: dict[str, Any]) -> dict[str, Any]:
        from shardforge.algorithms.serve.checkpoints import check_loadable, is_legacy, load_state

        if model.lora is None:
            # a missing, damaged or mismatched checkpoint fails here, on rank 0 alone (inside the ranks' job, a
            # failure would stop the service)
            folder = check_loadable(root, model, request, files=True)
            if is_legacy(folder):
                raise UserError(
                    f"checkpoint {request.get('path')!r} is a full fine-tuning state.pt of an earlier shardforge "
                    "serve, which loads on one rank only: load it with --nproc-per-node 1 and save_state it again "
                    "(DCP, loads on any number of ranks)"
                )
            self._run("full_load", model.model_id, str(folder), bool(request.get("optimizer")))
            return {"type": "load_weights", "path": str(request.get("path", "")), "model_id": model.model_id}
        result = load_state(root, model, request)  # a missing or mismatched checkpoint fails here, on rank 0 alone
        self._run("load", str(root), model.model_id, request)
        return result

    def close(self) -> None:
        """Tell the other ranks to stop (in a thread: at a signal they may be gone already)."""
        from shardforge.algorithms.serve.ranks import RankJob

        def stop() -> None:
            with self._lock:
                self._runtime.send(RankJob("stop"))

        thread = threading.Thread(target=stop, name="shardforge-serve-stop", daemon=True)
        thread.start()
        thread.join(timeout=5)


def sharded_ops(
    model_dir: str, layout: str, *, timeout_s: float = 600.0, report: Callable[[str], bool] | None = None
) -> OpsFactory:
    """The `OpsFactory` of rank 0 of a multi-rank service (collective: the other ranks build their
    `serve.ranks.RankRuntime` at the same time). ``report`` hands a fatal error's line to the launcher (the CLI
    passes `launch.torchrun.write_rank_error`; False: nobody listens, the line goes to stderr)."""

    def build(registry: ModelRegistry, batcher: LoRABatcher) -> ModelOps:
        from shardforge.algorithms.serve.ranks import RankRuntime

        runtime = RankRuntime(model_dir, layout, models=registry.models, timeout_s=timeout_s)
        return ShardedOps(runtime, registry, report)

    return build


def _fatal(op: str, exc: BaseException, report: Callable[[str], bool] | None) -> NoReturn:
    log.error("serve: the %r job failed on rank 0:\n%s", op, traceback.format_exc())
    line = (
        f"shardforge: error: serve: the {op!r} job that every rank runs failed on rank 0 ({type(exc).__name__}: "
        f"{exc}); the ranks are out of step, so the service stops\n"
    )
    if report is None or not report(line):
        sys.stderr.write(line)
    sys.stderr.flush()
    os._exit(1)
