"""Full fine-tuning on every rank of `shardforge serve --nproc-per-node N` (N > 1): the ops `serve.ranks.RankRuntime`
runs for a training client without ``lora_config``.

Such a client's trainable copy of the base is built by every rank together with the engine's `build_model` (the
trainers' composition order) on the base's mesh: its weights and its AdamW state are sharded with FSDP/HSDP like the
base, not replicated as LoRA adapters are. A ``forward_backward`` splits the request's datums over the data-parallel
ranks as the LoRA path does (`serve.rank_batch.split_rows`: a rank without datums runs a weight-0 row, since FSDP needs
every rank in every pass).

Gradient scale: Tinker's losses are sums over tokens, so the 1-rank gradient is the sum of the ranks' gradients of
their own datums' losses. FSDP's reduce-scatter (and HSDP's all-reduce over replicas) averages over the ``dp`` ranks,
so each rank backpropagates ``dp`` times its loss: the reduced gradient is then the sum.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.algorithms.serve.codecs import FwdBwdRequest
from shardforge.algorithms.serve.losses import LossResult
from shardforge.algorithms.serve.models import TrainingModel, adapter_optimizer
from shardforge.algorithms.serve.rank_batch import agreed_losses, gather_outcomes, split_rows
from shardforge.algorithms.serve.training import target_logprobs

if TYPE_CHECKING:
    from shardforge.engine.context import ParallelContext

__all__ = ["FullModelRanks"]


class FullModelRanks:
    """`RankRuntime`'s full fine-tuning ops (a mixin: ``ctx``, ``control``, ``models``, ``rank`` and ``_source`` are
    the runtime's). Every rank runs each op; rank 0 gets the answer."""

    ctx: ParallelContext
    control: dist.ProcessGroup
    models: dict[str, TrainingModel]
    rank: int

    _source: tuple[Any, Any, str]
    """What the runtime built the base from (head, HF config, model dir): a copy is built the same way."""

    def _build_trainable(self) -> nn.Module:
        """A sharded copy of the base with every weight trainable (collective: every rank builds its shard with the
        engine's `build_model` on the base's mesh)."""
        from shardforge.engine.build import build_model

        module, _ = build_model(self.ctx, *self._source)
        module.eval()  # as the base (and a 1-rank service's full copy): no dropout
        return module

    def op_full_create(self, owner: str, model_id: str, base_model: str, seed: int) -> nn.Module | None:
        """Build ``model_id``'s sharded copy. Rank 0 gets the module (its registry makes the model around it); the
        other ranks keep their shard as a `TrainingModel` of their own."""
        module = self._build_trainable()
        if self.rank == 0:
            return module
        params = [p for p in module.parameters() if p.requires_grad]
        self.models[model_id] = TrainingModel(
            model_id=model_id, owner=owner, base_model=base_model, lora=None, seed=seed, module=module,
            optimizer=adapter_optimizer(params),
        )  # fmt: skip
        return None

    def op_full_forward_backward(
        self, model_id: str, request: FwdBwdRequest
    ) -> list[tuple[torch.Tensor, LossResult] | str] | None:
        """The request over the ranks' data-parallel shares (see the module doc); rank 0 gets its (log-probs [T],
        loss summed over the ranks) or the loss's error, the others None."""
        model = self.models[model_id]
        local, datums = split_rows([(model, request)], self.ctx.dims.dp, self.ctx.dp_rank)
        train = not request.forward_only
        with torch.set_grad_enabled(train):
            logprobs_T = target_logprobs(model.module, datums)
            results, errors = agreed_losses(local, logprobs_T, self.control)
            if train and errors[0] is None:  # a failed loss leaves the gradients as they were, on every rank
                result = results[0]
                # the weight-0 row of a rank without datums still runs the backward's collectives
                loss = result.loss if result is not None else logprobs_T.sum() * 0.0
                (loss * self.ctx.dims.dp).backward()  # FSDP averages over dp ranks: dp x mean = the sum
        return gather_outcomes(local, logprobs_T, results, errors, self.control)

    def op_full_optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, Any]:
        """AdamW on every rank's shards (the gradient norm and clipping over all of them)."""
        from shardforge.algorithms.serve.training import optim_step

        return optim_step(self.models[model_id], adam)

    def op_full_weights(self, model_id: str) -> dict[str, torch.Tensor] | None:
        """Rank 0: every weight of ``model_id``, gathered whole onto the CPU (for sampling and exports)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module = self.models[model_id].module
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(module, options=options)  # rank 0 gets the full tensors, the others none
        if self.rank != 0:
            return None
        trained = {name for name, p in module.named_parameters() if p.requires_grad}
        return {name: value for name, value in state.items() if name in trained and isinstance(value, torch.Tensor)}

    def op_full_save(self, model_id: str, target: str) -> str | None:
        """Every rank writes its shards of ``model_id`` into the checkpoint ``target`` (rank 0 commits it). A failed
        save (a full disk: DCP raises it on every rank) is this request's error, not the service's end: the ranks
        agree on it over the control group and rank 0 gets it (None: saved)."""
        from shardforge.algorithms.serve.checkpoints import write_state

        error = None
        try:
            write_state(Path(target), self.models[model_id], collective=True)
        except Exception as exc:  # every rank is here, with its own error or None: the collectives stay in step
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=self.control)
        return next((e for e in errors if e is not None), None)

    def op_full_load(self, model_id: str, folder: str, optimizer: bool) -> None:
        """Every rank reads its shards of ``model_id`` from the checkpoint ``folder`` (saved on any rank count)."""
        from shardforge.algorithms.serve.checkpoints import read_into

        read_into(Path(folder), self.models[model_id], optimizer=optimizer, collective=True)
