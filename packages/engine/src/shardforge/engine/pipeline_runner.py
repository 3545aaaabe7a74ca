"""Pipeline parallelism (pp > 1): split the model into this rank's stages and run them.

Build (called from `shardforge.engine.build.build_model`, after TP and EP on the meta
model): split into this rank's stage(s) -> the same per-stage tail as every layout (AC -> expert
FSDP -> FSDP, `build.shard_module`) -> load rank 0's weights into the merged stage module. FSDP
keeps each stage's parameters gathered between micro-batches (``reshard_after_forward=False``):
a schedule runs every micro-batch's forward before (or interleaved with) the backwards, and
re-gathering per micro-batch would multiply all-gathers.

Every micro-batch is padded to one static length (pipelining sends activations of a fixed
shape); padding is its own sequence with zero loss weight. The engine's normalisation is
unchanged: each micro-batch's loss is a sum, scaled by ``dp_cp / global weight`` before
backward, so the step equals the non-pipelined one whatever the micro-batch count.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.checkpoint_dcp import Checkpointer, TrainState
from shardforge.engine.batching import (
    SEQUENCE_GROUP,
    PackedBatch,
    grouped_microbatches,
    sequence_start_mask,
    split_microbatches,
)
from shardforge.engine.checks import stages_per_rank
from shardforge.engine.context import ParallelContext
from shardforge.engine.heads import LMHead
from shardforge.engine.runners import LossFn, LossWeightFn, MicroBatches, Report, scatter_rows
from shardforge.fsdp_wrap import clip_grad_norm_, load_full_state_dict, total_grad_norm
from shardforge.pipeline import (
    Pipeline,
    merge_stages,
    resolve_schedule,
    split_decoder,
    split_layers,
    stack_packed_microbatches,
    stage_ids_for_rank,
    trim_cu_seqlens,
    valid_num_microbatches,
)
from shardforge.ulysses_cp import packed_model_kwargs

__all__ = ["PipelineRunner", "build_pipeline"]


def _layer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return packed_model_kwargs(trim_cu_seqlens(kwargs["cu_seqlens"]))


def _aligned(next_logprobs: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[L] next-token log-probs -> [T] target-aligned log-probs (0 at sequence starts)."""
    logprobs = torch.cat([next_logprobs.new_zeros(1), next_logprobs[:-1]])
    starts = sequence_start_mask(cu_seqlens.to(logprobs.device), logprobs.numel())
    return logprobs.masked_fill(starts, 0.0)[:num_tokens]


def build_pipeline(
    ctx: ParallelContext,
    head: LMHead,
    hf_config: Any,
    model: nn.Module,
    reference: nn.Module | None,
    shard_stage: Callable[[nn.Module], None],
) -> tuple[nn.Module, PipelineRunner]:
    """Split the (meta, TP/EP-applied) ``model`` into this rank's stages, apply ``shard_stage`` (the
    composition order's tail) to each, load rank 0's ``reference`` weights; return the module over
    this rank's stages (global parameter names) and its runner."""
    assert ctx.mesh is not None
    config, dims = ctx.config, ctx.dims
    spec = resolve_schedule(config.pp_schedule)
    v = stages_per_rank(config)
    layers = split_layers(int(hf_config.num_hidden_layers), dims.pp * v, config.pp_layers_per_stage)
    pp_rank = ctx.local_rank("pp")
    # Shapes are global (DTensor shapes under TP); non-persistent buffers are not in state dicts.
    meta = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
    owner = {stage: rank for rank in range(dims.pp) for stage in stage_ids_for_rank(rank, dims.pp, v, spec.style)}

    def output_fn(logits: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        # Last stage output: [1, L] log p(labels[t] | tokens <= t) at the head's temperature.
        return head.next_token_logprobs(logits[0], kwargs["labels"][0])[None]

    stages = split_decoder(
        model,
        layers,
        stage_ids_for_rank(pp_rank, dims.pp, v, spec.style),
        layer_kwargs_fn=_layer_kwargs,
        output_fn=output_fn,
    )
    for stage in stages:
        shard_stage(stage)
    merged = merge_stages(stages)
    full = reference.state_dict() if reference is not None else None
    buffers = dict(reference.named_buffers()) if reference is not None else None
    # Rank 0 broadcasts every entry; each rank keeps its stages' (hence strict=False).
    load_full_state_dict(merged, full, device=ctx.device, buffers=buffers, strict=False)
    schedule = Pipeline(stages, schedule=spec.name, group=ctx.mesh.get("pp").get_group(), device=ctx.device)
    runner = PipelineRunner(merged, ctx, schedule=schedule, stage_layers=layers, stage_owner=owner, tensor_meta=meta)
    return merged, runner


class PipelineRunner:
    """Runs this rank's pipeline stages (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        ctx: ParallelContext,
        *,
        schedule: Pipeline,
        stage_layers: list[range],
        stage_owner: dict[int, int],
        tensor_meta: dict[str, tuple[tuple[int, ...], torch.dtype]],
    ) -> None:
        assert ctx.mesh is not None
        self.model, self.ctx, self.schedule = model, ctx, schedule
        self.stage_layers = stage_layers
        """Global layer indices of every stage."""
        self.stage_owner = stage_owner
        """Stage index -> pp rank that runs it."""
        self.tensor_meta = tensor_meta
        """Global shape and dtype of every state-dict entry of the whole model, in HF order."""
        self.pp_mesh = ctx.mesh.get("pp")
        self.pp_group = self.pp_mesh.get_group()

    @property
    def last_stage_pp_rank(self) -> int:
        return self.stage_owner[len(self.stage_layers) - 1]

    def owner_pp_rank(self, name: str) -> int:
        """The pp rank whose stage holds state-dict entry ``name``."""
        if ".layers." in name:
            index = int(name.split(".layers.")[1].split(".")[0])
            stage = next(s for s, layers in enumerate(self.stage_layers) if index in layers)
        elif "embed_tokens" in name:
            stage = 0
        else:  # final norm, lm_head
            stage = len(self.stage_layers) - 1
        return self.stage_owner[stage]

    # ------------------------------------------------------------------ running
    def microbatches(self, batch: PackedBatch) -> MicroBatches:
        """Micro-batches (agreed count, valid for the schedule) and the stacked static-shape inputs."""
        ctx = self.ctx
        pp, budget = ctx.dims.pp, ctx.config.max_tokens_per_microbatch
        minimum = ctx.config.pp_num_microbatches or pp * stages_per_rank(ctx.config)
        if SEQUENCE_GROUP in batch.extras:  # keep groups (e.g. chosen/rejected pairs) in one micro-batch
            mbs = grouped_microbatches(batch, budget, group=ctx.world_group, min_count=minimum)
        else:
            mbs = split_microbatches(batch, budget, group=ctx.world_group, min_count=minimum)
        count = valid_num_microbatches(ctx.config.pp_schedule, pp, len(mbs))
        mbs = mbs + [([], None)] * (count - len(mbs))
        empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.int32))
        rows = [(mb.input_ids, mb.position_ids, mb.cu_seqlens) if mb is not None else empty for _, mb in mbs]
        multiple = ctx.token_multiple
        stacked = stack_packed_microbatches(rows, -(-budget // multiple) * multiple)
        dev = ctx.device
        kwargs = {
            "position_ids": stacked.position_ids.to(dev),
            "cu_seqlens": stacked.cu_seqlens.to(dev),
            "labels": torch.roll(stacked.input_ids, -1, dims=1).to(dev),
        }
        return MicroBatches(mbs, data=(kwargs, stacked.input_ids.to(dev), stacked.num_tokens))

    def _reports_stats(self) -> bool:
        """One rank per data-parallel replica reports the loss: the last stage's first TP rank."""
        return self.schedule.has_last_stage and self.ctx.local_rank("tp") == 0

    def _reports_data(self) -> bool:
        return self.ctx.local_rank("pp") == 0 and self.ctx.local_rank("tp") == 0

    def forward_backward(
        self,
        mbs: MicroBatches,
        loss_fn: LossFn,
        grad_scale: float,
        *,
        wants_entropy: bool,
        wants_distribution: bool = False,
    ) -> tuple[float, dict[str, float]]:
        if wants_entropy or wants_distribution:
            raise NotImplementedError(
                "entropy- or distribution-aware losses (loss_fn.wants_entropy / wants_distribution) are not "
                "supported with pp > 1 yet"
            )
        kwargs, input_ids, num_tokens = mbs.data
        cu_rows = kwargs["cu_seqlens"]

        def microbatch_loss(next_logprobs: torch.Tensor, i: int) -> torch.Tensor:
            mb = mbs.items[i][1]
            if mb is None:  # an all-padding micro-batch: keep the graph, contribute nothing
                return next_logprobs.sum() * 0.0
            logprobs = _aligned(next_logprobs[0], cu_rows[i], num_tokens[i])
            return loss_fn(logprobs, mb.to(self.ctx.device)) * grad_scale

        losses = self.schedule.step(input_ids, loss_fn=microbatch_loss, **kwargs)
        return float(sum(float(x.detach()) for x in losses)) / grad_scale, {}

    def grad_norm(self, params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
        if max_norm:
            return clip_grad_norm_(params, max_norm, pp_mesh=self.pp_mesh)
        return total_grad_norm(params, pp_mesh=self.pp_mesh)

    def stats_report(self) -> tuple[bool, dist.ProcessGroup | None]:
        return self._reports_stats(), self.ctx.world_group

    def report_step(self, loss_sum: float, num_tokens: int) -> Report:
        loss = loss_sum if self._reports_stats() else 0.0
        tokens = float(num_tokens) if self._reports_data() else 0.0
        return Report((loss, tokens), self.ctx.world_group)

    def _forward_rows(self, batch: PackedBatch) -> tuple[MicroBatches, list[torch.Tensor] | None]:
        """Micro-batches and, on the last stage's rank, each one's target-aligned log-probs."""
        mbs = self.microbatches(batch)
        kwargs, input_ids, num_tokens = mbs.data
        out = self.schedule.forward(input_ids, **kwargs)
        if out is None:
            return mbs, None
        rows = [_aligned(out[i], kwargs["cu_seqlens"][i], num_tokens[i]).float().cpu() for i in range(len(mbs.items))]
        return mbs, rows

    def forward_distribution(self, batch: PackedBatch, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError("full next-token distributions are not supported with pp > 1 yet; use pp=1")

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Computed on the last stage, broadcast to the pp group."""
        mbs, rows = self._forward_rows(batch)
        out = torch.zeros(batch.num_tokens, dtype=torch.float32)
        bounds = batch.cu_seqlens.tolist()
        if rows is not None:
            for (indices, mb), logprobs in zip(mbs.items, rows, strict=True):
                if mb is not None:
                    scatter_rows(out, bounds, indices, logprobs)
        buf = out.to(self.ctx.device)
        src = dist.get_global_rank(self.pp_group, self.last_stage_pp_rank)
        dist.broadcast(buf, src=src, group=self.pp_group)
        return buf.cpu()

    def eval_sums(self, batch: PackedBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> Report:
        mbs, rows = self._forward_rows(batch)
        loss_sum, weight = 0.0, 0.0
        for k, (_, mb) in enumerate(mbs.items):
            if mb is None:
                continue
            weight += float(loss_weight_fn(mb))
            if rows is not None:
                loss_sum += float(loss_fn(rows[k].to(self.ctx.device), mb.to(self.ctx.device)))
        reports = self._reports_stats()
        return Report((loss_sum if reports else 0.0, weight if reports else 0.0), self.ctx.world_group)

    # ------------------------------------------------------------------ full tensors
    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every state-dict entry of the whole model in HF order, full, yielded on rank 0. Collective.

        The ranks of each stage gather an entry (``full_tensor`` over their FSDP/TP mesh); the
        member of rank 0's pp group that owns it sends it to rank 0, which knows every shape and
        dtype from the meta model. Other ranks yield nothing.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        local = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))
        members = [dist.get_global_rank(self.pp_group, r) for r in range(self.ctx.dims.pp)]
        relays = 0 in members  # global rank 0 is pp rank 0 of this group
        my_pp = self.ctx.local_rank("pp")
        for name, (shape, dtype) in self.tensor_meta.items():
            value = local.get(name)
            full = None
            if isinstance(value, torch.Tensor):
                full = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
            if not relays:
                continue
            owner = self.owner_pp_rank(name)
            if dist.get_rank() == 0:
                if owner != 0:
                    full = torch.empty(shape, dtype=dtype, device=self.ctx.device)
                    dist.recv(full, src=members[owner], group=self.pp_group)
                assert full is not None
                yield name, full.cpu()
            elif owner == my_pp:
                assert full is not None
                dist.send(full.contiguous(), dst=0, group=self.pp_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = {name: tensor.clone() for name, tensor in self.full_tensors()}
        return state if dist.get_rank() == 0 else {}

    def export_hf(self, out_dir: str | os.PathLike[str], config: Any, tokenizer: Any, dtype: Any) -> None:
        """Stream the tensors relayed to rank 0 into an HF directory (`checkpoint_dcp.write_hf_dir`)."""
        from shardforge.checkpoint_dcp import write_hf_dir

        if dist.get_rank() == 0:
            write_hf_dir(self.full_tensors(), out_dir, config, tokenizer, dtype=dtype)
        else:
            for _ in self.full_tensors():  # the other ranks' sends
                pass
        dist.barrier()

    def load(self, checkpointer: Checkpointer, state: TrainState, step: int | str) -> bool:
        """Each rank reads its stages' entries of a checkpoint of any layout.

        `Checkpointer.load` checks the checkpoint against the rank's model, which under PP holds
        only some stages; here the checkpoint is checked against the *whole* model's names and
        global shapes (the same check on every rank), then DCP reads what each rank holds.
        """
        import torch.distributed.checkpoint as dcp

        from shardforge.checkpoint_dcp import COMMIT_MARKER, checkpoint_tensor_shapes

        checkpointer.wait()
        if step == "latest":
            latest = checkpointer.latest_step()
            if latest is None:
                return False
            step = latest
        path = checkpointer.path(int(step))
        if not (path / COMMIT_MARKER).is_file():
            raise FileNotFoundError(f"no committed checkpoint for step {step} under {path.parent}")
        prefix = "train.model."
        saved = {k[len(prefix) :]: s for k, s in checkpoint_tensor_shapes(path).items() if k.startswith(prefix)}
        expected = {k: shape for k, (shape, _) in self.tensor_meta.items()}
        if saved != expected:
            missing = sorted(set(expected) - set(saved))[:10]
            unexpected = sorted(set(saved) - set(expected))[:10]
            shapes = sorted(k for k in set(saved) & set(expected) if saved[k] != expected[k])[:10]
            raise ValueError(
                f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}, "
                f"shape mismatch {shapes}; load a checkpoint saved from the same model architecture (layout may differ)"
            )
        dcp.load({"train": state}, storage_reader=dcp.FileSystemReader(str(path)))
        return True
