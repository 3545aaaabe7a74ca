"""Runners: how one engine runs micro-batches on its layout.

`TrainEngine` normalises the loss, clips, steps and reports once; a runner does what differs
between a model every rank runs whole (`SPMDRunner`: FSDP/HSDP/TP/CP/EP) and a model split into
pipeline stages (`shardforge.engine.pipeline_runner.PipelineRunner`):
micro-batching, forward/backward, the gradient norm, which ranks report which statistic, the
full tensors for export, and checkpoint loading.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardforge.checkpoint_dcp import Checkpointer, TrainState, export_hf
from shardforge.engine.batching import (
    SEQUENCE_GROUP,
    PackedBatch,
    grouped_microbatches,
    share_prefixes,
    split_microbatches,
    unshare_outputs,
)
from shardforge.engine.context import ParallelContext
from shardforge.engine.features.moe import MoETraining, aux_term, moe_stats, recording
from shardforge.engine.features.prefix_sharing import use_prefix_sharing
from shardforge.engine.features.router_replay import build_router_replay, replay_stats, replaying
from shardforge.engine.heads import Head
from shardforge.fsdp_wrap import clip_grad_norm_, total_grad_norm

__all__ = ["LossFn", "LossWeightFn", "MicroBatches", "Report", "Runner", "SPMDRunner", "dummy_microbatch"]

LossFn = Any
"""(outputs [T], micro-batch[, entropy=[T]][, distribution=[T, V]]) -> summed loss (see
`shardforge.engine.LossFn`)."""
LossWeightFn = Any
"""micro-batch -> its weight in the global normalisation."""


@dataclass
class MicroBatches:
    """One step's micro-batches: (sequence indices, micro-batch or None for a placeholder) each."""

    items: list[tuple[list[int], PackedBatch | None]]
    data: Any = None
    """Runner-specific inputs (the pipeline's stacked tensors)."""


@dataclass(frozen=True)
class Report:
    """What this rank adds to a global statistic, and the group the engine sums it over."""

    values: tuple[float, ...]
    group: dist.ProcessGroup | None


class Runner(Protocol):
    """What `TrainEngine` needs from a layout (see the module docstring)."""

    model: nn.Module

    def microbatches(self, batch: PackedBatch) -> MicroBatches: ...

    def forward_backward(
        self,
        mbs: MicroBatches,
        loss_fn: LossFn,
        grad_scale: float,
        *,
        wants_entropy: bool,
        wants_distribution: bool = False,
    ) -> tuple[float, dict[str, float]]:
        """Run every micro-batch forward and backward with losses scaled by ``grad_scale``; return
        this rank's unscaled loss sum and extra statistics."""
        ...

    def grad_norm(self, params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor: ...

    def report_step(self, loss_sum: float, num_tokens: int) -> Report: ...

    def stats_report(self) -> tuple[bool, dist.ProcessGroup | None]:
        """Whether this rank's loss-function statistics count, and the group that sums them globally."""
        ...

    def forward(self, batch: PackedBatch) -> torch.Tensor: ...

    def forward_distribution(self, batch: PackedBatch, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def eval_sums(self, batch: PackedBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> Report: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def export_hf(self, out_dir: str | os.PathLike[str], config: Any, tokenizer: Any, dtype: Any) -> None: ...

    def load(self, checkpointer: Checkpointer, state: TrainState, step: int | str) -> bool: ...


def dummy_microbatch() -> PackedBatch:
    """One token with zero loss weight. Ranks with fewer sequences than the agreed micro-batch
    count still run forward and backward on it (FSDP collectives must match)."""
    return PackedBatch(
        input_ids=torch.zeros(1, dtype=torch.long),
        position_ids=torch.zeros(1, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        loss_mask=torch.zeros(1),
    )


def scatter_rows(out: torch.Tensor, bounds: list[int], indices: list[int], values: torch.Tensor) -> None:
    """Write a micro-batch's per-token ``values`` back to its sequences' places in ``out``."""
    offset = 0
    for i in indices:
        length = bounds[i + 1] - bounds[i]
        out[bounds[i] : bounds[i + 1]] = values[offset : offset + length]
        offset += length


class SPMDRunner:
    """Every rank runs the whole (sharded) model: FSDP/HSDP, TP, CP, EP and one process."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, head: Head, moe: MoETraining | None) -> None:
        self.model, self.ctx, self.head, self.moe = model, ctx, head, moe
        self.replay = build_router_replay(model, ctx.config.router_replay and moe is not None)
        hf_config = getattr(model, "config", None)
        self.share_prefixes = use_prefix_sharing(ctx, head, hf_config, moe is not None)

    def microbatches(self, batch: PackedBatch) -> MicroBatches:
        budget, group = self.ctx.config.max_tokens_per_microbatch, self.ctx.world_group
        if SEQUENCE_GROUP in batch.extras:  # keep groups (e.g. chosen/rejected pairs) in one micro-batch
            items = grouped_microbatches(batch, budget, group=group)
        else:
            items = split_microbatches(batch, budget, group=group)
        if self.share_prefixes:  # after the split: sharing only removes tokens (engine.features.prefix_sharing)
            items = [(indices, share_prefixes(mb) if mb is not None else None) for indices, mb in items]
        return MicroBatches(items)

    def forward_backward(
        self,
        mbs: MicroBatches,
        loss_fn: LossFn,
        grad_scale: float,
        *,
        wants_entropy: bool,
        wants_distribution: bool = False,
    ) -> tuple[float, dict[str, float]]:
        loss_sum = torch.zeros((), dtype=torch.float64)
        for _, mb in mbs.items:
            real = mb is not None
            mb = (mb if mb is not None else dummy_microbatch()).to(self.ctx.device)
            with replaying(self.replay, mb):  # forward and backward (activation-checkpoint recompute)
                kwargs: dict[str, Any] = {}
                with recording(self.moe, mb.num_tokens, real):
                    if wants_distribution:
                        outputs, entropy, kwargs["distribution"] = self.head.distribution_outputs(
                            self.model, self.ctx, mb, entropy=wants_entropy
                        )
                    else:
                        outputs, entropy = self.head.outputs(self.model, self.ctx, mb, entropy=wants_entropy)
                if wants_entropy:
                    kwargs["entropy"] = entropy
                loss = loss_fn(outputs, mb, **kwargs)
                if not real:
                    loss = loss * 0.0
                (loss * grad_scale + aux_term(self.moe, len(mbs.items))).backward()
            loss_sum += loss.detach().double().cpu()
        stats = moe_stats(self.moe) | replay_stats(self.replay, self.ctx.dp_group, self.ctx.device)
        return float(loss_sum), stats

    def grad_norm(self, params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm_(params, max_norm) if max_norm else total_grad_norm(params)

    def report_step(self, loss_sum: float, num_tokens: int) -> Report:
        return Report((loss_sum, float(num_tokens)), self.ctx.dp_group)

    def stats_report(self) -> tuple[bool, dist.ProcessGroup | None]:
        return True, self.ctx.dp_group  # TP/CP ranks hold copies: sum over data-parallel ranks only

    def _outputs(self, mb: PackedBatch | None) -> torch.Tensor:
        mb = mb if mb is not None else dummy_microbatch()
        with replaying(self.replay, mb):
            return self.head.outputs(self.model, self.ctx, mb, entropy=False)[0]

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        out = torch.zeros(batch.num_tokens, dtype=torch.float32)
        bounds = batch.cu_seqlens.tolist()
        for indices, mb in self.microbatches(batch).items:
            values = self._outputs(mb).cpu()
            if mb is not None:
                scatter_rows(out, bounds, indices, unshare_outputs(values, mb))
        return out

    def forward_distribution(self, batch: PackedBatch, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T, V] float32 log-probs of each target's distribution (rows off ``loss_mask`` are 0; top_k > 0:
        the [T, k] largest and their [T, k] token ids), on the host."""
        bounds = batch.cu_seqlens.tolist()
        rows: torch.Tensor | None = None
        ids: torch.Tensor | None = None
        for indices, mb in self.microbatches(batch).items:
            run = mb if mb is not None else dummy_microbatch()  # every rank runs as many forwards (FSDP)
            with replaying(self.replay, run):
                log_p = self.head.distribution_outputs(self.model, self.ctx, run, entropy=False)[2]
            if mb is None:
                continue
            targets = mb.loss_mask
            if mb.unshared_index is not None:  # back to the micro-batch's rows before prefix sharing
                log_p = unshare_outputs(log_p, mb)
                targets = torch.cat([batch.loss_mask[bounds[i] : bounds[i + 1]] for i in indices])
            log_p = log_p.masked_fill((targets == 0).to(log_p.device)[:, None], 0.0)
            top = log_p.topk(top_k, dim=-1) if top_k > 0 else None
            values = (top.values if top is not None else log_p).cpu()
            if rows is None:
                rows = torch.zeros(batch.num_tokens, values.shape[1], dtype=torch.float32)
                ids = torch.zeros(batch.num_tokens, top_k, dtype=torch.long) if top is not None else None
            scatter_rows(rows, bounds, indices, values)
            if top is not None and ids is not None:
                scatter_rows(ids, bounds, indices, top.indices.cpu())
        if rows is None:  # no sequence on this rank
            rows = torch.zeros(batch.num_tokens, max(top_k, 0), dtype=torch.float32)
            ids = torch.zeros(batch.num_tokens, top_k, dtype=torch.long) if top_k > 0 else None
        return rows, ids

    def eval_sums(self, batch: PackedBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> Report:
        loss_sum, weight = 0.0, 0.0
        for _, mb in self.microbatches(batch).items:
            outputs = self._outputs(mb)
            if mb is None:
                continue
            loss_sum += float(loss_fn(outputs, mb.to(self.ctx.device)).double())
            weight += float(loss_weight_fn(mb).double())
        return Report((loss_sum, weight), self.ctx.dp_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not dist.is_initialized():
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return dict(state) if dist.get_rank() == 0 else {}  # type: ignore[arg-type]

    def export_hf(self, out_dir: str | os.PathLike[str], config: Any, tokenizer: Any, dtype: Any) -> None:
        export_hf(self.model, out_dir, config, tokenizer, dtype=dtype)

    def load(self, checkpointer: Checkpointer, state: TrainState, step: int | str) -> bool:
        return checkpointer.load({"train": state}, step=step) is not None  # type: ignore[arg-type]
