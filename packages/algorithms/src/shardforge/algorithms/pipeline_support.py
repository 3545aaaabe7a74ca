"""Pipeline parallelism inside `TrainEngine` (pp > 1): build the stages, run batches, export.

Build order (the engine's): TP on the meta model -> split into this rank's stage(s) ->
activation checkpointing -> FSDP per stage -> load rank 0's weights into the (merged) stage
module. FSDP keeps each stage's parameters gathered between micro-batches
(``reshard_after_forward=False``): a schedule runs every micro-batch's forward before (or
interleaved with) the backwards, and re-gathering per micro-batch would multiply all-gathers.

Every micro-batch is padded to one static length (pipelining sends activations of a fixed
shape); padding is its own sequence with zero loss weight. The engine's normalisation is
unchanged: each micro-batch's loss is a sum, scaled by ``dp_cp / global weight`` before
backward, so the step equals the non-pipelined one whatever the micro-batch count.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.algorithms.batching import PackedBatch, sequence_start_mask, split_microbatches
from shardforge.fsdp_wrap import (
    apply_activation_checkpointing,
    apply_fsdp,
    clip_grad_norm_,
    load_full_state_dict,
    total_grad_norm,
)
from shardforge.mesh import ParallelDims
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
from shardforge.tensor_parallel import vocab_parallel_logprobs
from shardforge.ulysses_cp import packed_model_kwargs

if TYPE_CHECKING:
    from shardforge.algorithms.config import EngineConfig
    from shardforge.algorithms.engine import LossFn, LossWeightFn, TrainEngine
    from shardforge.checkpoint_dcp import Checkpointer

__all__ = [
    "EnginePipeline",
    "build_pipeline_model",
    "pp_eval_batch",
    "pp_export_hf",
    "pp_forward",
    "pp_full_state_dict",
    "pp_load",
    "pp_train_batch",
    "stages_per_rank",
    "validate_pipeline",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EnginePipeline:
    """What the engine keeps about its pipeline."""

    runner: Pipeline
    """This rank's stages and the schedule."""
    stage_layers: list[range]
    """Global layer indices of every stage."""
    stage_owner: dict[int, int]
    """Stage index -> pp rank that runs it."""
    tensor_meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """Global shape and dtype of every state-dict entry of the whole model, in HF order."""

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


def stages_per_rank(config: EngineConfig) -> int:
    spec = resolve_schedule(config.pp_schedule)
    return config.pp_stages_per_rank or spec.default_stages_per_rank


def validate_pipeline(dims: ParallelDims, hf_config: Any, config: EngineConfig) -> None:
    """Check the pipeline settings against the model before any collective; raise `ValueError`."""
    spec = resolve_schedule(config.pp_schedule)
    v = stages_per_rank(config)
    if not spec.multi_stage and v != 1:
        raise ValueError(
            f"pp_schedule={spec.name} runs one stage per rank but pp_stages_per_rank={v}; "
            "use Interleaved1F1B or ZBVZeroBubble for virtual stages"
        )
    if spec.name == "ZBVZeroBubble" and v != 2:
        raise ValueError(f"pp_schedule=ZBVZeroBubble needs pp_stages_per_rank=2, got {v}")
    split_layers(int(hf_config.num_hidden_layers), dims.pp * v, config.pp_layers_per_stage)
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError(
            "pp > 1 puts the input embedding and lm_head on different stages, but the model ties them "
            "(tie_word_embeddings=True); use pp=1 or an untied model"
        )
    if dims.cp > 1:
        raise ValueError(f"pp={dims.pp} with cp={dims.cp} is not supported yet; use pp with FSDP/TP (letters p, d, t)")
    if dims.ep > 1:
        raise ValueError(f"pp={dims.pp} with ep={dims.ep} is not supported yet")


# ---------------------------------------------------------------------------------- build
def _layer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return packed_model_kwargs(trim_cu_seqlens(kwargs["cu_seqlens"]))


def _next_token_logprobs(logits: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """Last stage output: [1, L] log p(labels[t] | tokens <= t); vocab-parallel under TP."""
    labels = kwargs["labels"][0]
    logits = logits[0]
    if isinstance(logits, DTensor):
        return vocab_parallel_logprobs(logits, labels)[None]
    return -F.cross_entropy(logits.float(), labels, reduction="none")[None]


def build_pipeline_model(engine: TrainEngine, model: nn.Module, reference: nn.Module | None) -> nn.Module:
    """Split the (meta, TP-applied) ``model`` into this rank's stages, shard and load them.

    Sets ``engine.pipeline`` and returns the module over this rank's stages with global names.
    """
    assert engine.mesh is not None
    config, dims = engine.config, engine.dims
    spec = resolve_schedule(config.pp_schedule)
    v = stages_per_rank(config)
    layers = split_layers(int(engine.hf_config.num_hidden_layers), dims.pp * v, config.pp_layers_per_stage)
    pp_rank = engine.mesh.local_rank("pp")
    # Shapes are global (DTensor shapes under TP); non-persistent buffers are not in state dicts.
    meta = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
    owner = {stage: rank for rank in range(dims.pp) for stage in stage_ids_for_rank(rank, dims.pp, v, spec.style)}
    stages = split_decoder(
        model,
        layers,
        stage_ids_for_rank(pp_rank, dims.pp, v, spec.style),
        layer_kwargs_fn=_layer_kwargs,
        output_fn=lambda logits, kwargs: _next_token_logprobs(logits / engine.logprob_temperature, kwargs),
    )
    fsdp_mesh = engine._fsdp_mesh()
    fsdp_config = dataclasses.replace(engine._fsdp_config(), reshard_after_forward=False)
    for stage in stages:
        apply_activation_checkpointing(stage, engine._ac_config())
        if fsdp_mesh is not None:
            apply_fsdp(stage, fsdp_mesh, fsdp_config)
    merged = merge_stages(stages)
    full = reference.state_dict() if reference is not None else None
    buffers = dict(reference.named_buffers()) if reference is not None else None
    # Rank 0 broadcasts every entry; each rank keeps its stages' (hence strict=False).
    load_full_state_dict(merged, full, device=engine.device, buffers=buffers, strict=False)
    runner = Pipeline(stages, schedule=spec.name, group=engine.mesh.get("pp").get_group(), device=engine.device)
    engine.pipeline = EnginePipeline(runner=runner, stage_layers=layers, stage_owner=owner, tensor_meta=meta)
    return merged


# ---------------------------------------------------------------------------------- running
def _seq_len(engine: TrainEngine) -> int:
    multiple = engine._token_multiple
    budget = engine.config.max_tokens_per_microbatch
    return -(-budget // multiple) * multiple


def _stacked(
    engine: TrainEngine, batch: PackedBatch
) -> tuple[list[tuple[list[int], PackedBatch | None]], dict[str, torch.Tensor], torch.Tensor, tuple[int, ...]]:
    """Micro-batches (agreed count, valid for the schedule) and the stacked model inputs."""
    pp = engine.dims.pp
    minimum = engine.config.pp_num_microbatches or pp * stages_per_rank(engine.config)
    group = dist.group.WORLD if dist.is_initialized() else None
    mbs = split_microbatches(batch, engine.config.max_tokens_per_microbatch, group=group, min_count=minimum)
    count = valid_num_microbatches(engine.config.pp_schedule, pp, len(mbs))
    mbs = mbs + [([], None)] * (count - len(mbs))
    empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.int32))
    rows = [(mb.input_ids, mb.position_ids, mb.cu_seqlens) if mb is not None else empty for _, mb in mbs]
    stacked = stack_packed_microbatches(rows, _seq_len(engine))
    dev = engine.device
    kwargs = {
        "position_ids": stacked.position_ids.to(dev),
        "cu_seqlens": stacked.cu_seqlens.to(dev),
        "labels": torch.roll(stacked.input_ids, -1, dims=1).to(dev),
    }
    return mbs, kwargs, stacked.input_ids.to(dev), stacked.num_tokens


def _aligned(next_logprobs: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[L] next-token log-probs -> [T] target-aligned log-probs (0 at sequence starts)."""
    logprobs = torch.cat([next_logprobs.new_zeros(1), next_logprobs[:-1]])
    starts = sequence_start_mask(cu_seqlens.to(logprobs.device), logprobs.numel())
    return logprobs.masked_fill(starts, 0.0)[:num_tokens]


def _reports_stats(engine: TrainEngine) -> bool:
    """One rank per data-parallel replica reports the loss: the last stage's first TP rank."""
    assert engine.pipeline is not None and engine.mesh is not None
    return engine.pipeline.runner.has_last_stage and engine.mesh.local_rank("tp") == 0


def _reports_data(engine: TrainEngine) -> bool:
    assert engine.mesh is not None
    return engine.mesh.local_rank("pp") == 0 and engine.mesh.local_rank("tp") == 0


def pp_train_batch(
    engine: TrainEngine, batch: PackedBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn
) -> dict[str, float]:
    """`TrainEngine.train_batch` under pipeline parallelism."""
    assert engine.pipeline is not None and engine.mesh is not None
    start = time.perf_counter()
    engine.model.train()
    mbs, kwargs, input_ids, num_tokens = _stacked(engine, batch)
    local_weight = sum(
        (loss_weight_fn(mb).detach().double() for _, mb in mbs if mb is not None), torch.zeros((), dtype=torch.float64)
    )
    [global_weight] = engine._all_reduce_sum(local_weight, group=engine.dp_group)
    if global_weight <= 0:
        raise ValueError("the global batch has zero loss weight (no target tokens on any rank); check loss_mask")
    grad_scale = engine.dims.dp_cp / global_weight
    cu_rows = kwargs["cu_seqlens"]

    def microbatch_loss(next_logprobs: torch.Tensor, i: int) -> torch.Tensor:
        mb = mbs[i][1]
        if mb is None:  # an all-padding micro-batch: keep the graph, contribute nothing
            return next_logprobs.sum() * 0.0
        logprobs = _aligned(next_logprobs[0], cu_rows[i], num_tokens[i])
        return loss_fn(logprobs, mb.to(engine.device)) * grad_scale

    losses = engine.pipeline.runner.step(input_ids, loss_fn=microbatch_loss, **kwargs)
    loss_sum = float(sum(float(x.detach()) for x in losses)) / grad_scale
    params = [p for p in engine.model.parameters() if p.requires_grad]
    pp_mesh = engine.mesh.get("pp")
    max_norm = engine.config.optimizer.max_grad_norm
    grad_norm = (
        clip_grad_norm_(params, max_norm, pp_mesh=pp_mesh) if max_norm else total_grad_norm(params, pp_mesh=pp_mesh)
    )
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    lr = engine.scheduler.get_last_lr()[0]
    engine.scheduler.step()
    engine.step += 1
    loss_total, tokens = engine._all_reduce_sum(
        loss_sum if _reports_stats(engine) else 0.0,
        batch.num_tokens if _reports_data(engine) else 0,
        group=dist.group.WORLD,
    )
    return {
        "loss": loss_total / global_weight,
        "grad_norm": float(grad_norm),
        "lr": float(lr),
        "loss_weight": global_weight,
        "tokens": tokens,
        "microbatches": float(len(mbs)),
        "skipped": float(not finite),
        "step_time_s": time.perf_counter() - start,
    }


def _forward_logprobs(engine: TrainEngine, batch: PackedBatch) -> tuple[list[Any], list[torch.Tensor] | None]:
    """Micro-batches and, on the last stage's rank, each one's target-aligned log-probs."""
    assert engine.pipeline is not None
    engine.model.eval()
    mbs, kwargs, input_ids, num_tokens = _stacked(engine, batch)
    out = engine.pipeline.runner.forward(input_ids, **kwargs)
    if out is None:
        return mbs, None
    rows = [_aligned(out[i], kwargs["cu_seqlens"][i], num_tokens[i]).float().cpu() for i in range(len(mbs))]
    return mbs, rows


@torch.no_grad()
def pp_forward(engine: TrainEngine, batch: PackedBatch) -> torch.Tensor:
    """`TrainEngine.forward` under PP: computed on the last stage, broadcast to the pp group."""
    assert engine.mesh is not None
    mbs, rows = _forward_logprobs(engine, batch)
    out = torch.zeros(batch.num_tokens, dtype=torch.float32)
    bounds = batch.cu_seqlens.tolist()
    if rows is not None:
        for (indices, mb), logprobs in zip(mbs, rows, strict=True):
            if mb is None:
                continue
            offset = 0
            for i in indices:
                length = bounds[i + 1] - bounds[i]
                out[bounds[i] : bounds[i + 1]] = logprobs[offset : offset + length]
                offset += length
    assert engine.pipeline is not None
    pp_group = engine.mesh.get("pp").get_group()
    last = engine.pipeline.last_stage_pp_rank
    buf = out.to(engine.device)
    dist.broadcast(buf, src=dist.get_global_rank(pp_group, last), group=pp_group)
    return buf.cpu()


@torch.no_grad()
def pp_eval_batch(
    engine: TrainEngine, batch: PackedBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn
) -> dict[str, float]:
    """`TrainEngine.eval_batch` under PP."""
    mbs, rows = _forward_logprobs(engine, batch)
    loss_sum = 0.0
    weight = 0.0
    for k, (_, mb) in enumerate(mbs):
        if mb is None:
            continue
        weight += float(loss_weight_fn(mb))
        if rows is not None:
            loss_sum += float(loss_fn(rows[k].to(engine.device), mb.to(engine.device)))
    reports = _reports_stats(engine)
    total, weight_total = engine._all_reduce_sum(
        loss_sum if reports else 0.0, weight if reports else 0.0, group=dist.group.WORLD
    )
    return {"loss": total / max(weight_total, 1e-12), "loss_weight": weight_total}


# ---------------------------------------------------------------------------------- export
def _full_tensors(engine: TrainEngine) -> Iterator[tuple[str, torch.Tensor]]:
    """Every state-dict entry of the whole model in HF order, full, yielded on rank 0. Collective.

    The ranks of each stage gather an entry (``full_tensor`` over their FSDP/TP mesh); the
    member of rank 0's pp group that owns it sends it to rank 0, which knows every shape and
    dtype from the meta model. Other ranks yield nothing.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    assert engine.mesh is not None and engine.pipeline is not None
    local = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=False))
    pp_group = engine.mesh.get("pp").get_group()
    members = [dist.get_global_rank(pp_group, r) for r in range(engine.dims.pp)]
    relays = 0 in members  # global rank 0 is pp rank 0 of this group
    my_pp = engine.mesh.local_rank("pp")
    for name, (shape, dtype) in engine.pipeline.tensor_meta.items():
        value = local.get(name)
        full = None
        if isinstance(value, torch.Tensor):
            full = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        if not relays:
            continue
        owner = engine.pipeline.owner_pp_rank(name)
        if dist.get_rank() == 0:
            if owner != 0:
                full = torch.empty(shape, dtype=dtype, device=engine.device)
                dist.recv(full, src=members[owner], group=pp_group)
            assert full is not None
            yield name, full.cpu()
        elif owner == my_pp:
            assert full is not None
            dist.send(full.contiguous(), dst=0, group=pp_group)


def pp_full_state_dict(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """`TrainEngine.full_state_dict` under PP (rank 0 gets everything)."""
    state = {name: tensor.clone() for name, tensor in _full_tensors(engine)}
    return state if dist.get_rank() == 0 else {}


def pp_export_hf(engine: TrainEngine, out_dir: str | os.PathLike[str], config: Any, tokenizer: Any, dtype: Any) -> None:
    """`TrainEngine.export_hf` under PP: stream the gathered tensors into safetensors on rank 0."""
    import copy
    import shutil

    from shardforge.checkpoint_dcp import write_safetensors_shards

    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in _full_tensors(engine):
            yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor

    if dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        write_safetensors_shards(tensors(), tmp)
        hf_config = copy.deepcopy(config)
        hf_config._attn_implementation = "sdpa"
        if dtype is not None:
            hf_config.dtype = dtype
        hf_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    else:
        for _ in tensors():
            pass
    dist.barrier()


# ---------------------------------------------------------------------------------- checkpoints
def pp_load(engine: TrainEngine, checkpointer: Checkpointer, step: int | str = "latest") -> dict[str, Any] | None:
    """`TrainEngine.load` under PP: each rank reads its stages' entries of a checkpoint of any layout.

    `Checkpointer.load` checks the checkpoint against the rank's model, which under PP holds
    only some stages; here the checkpoint is checked against the *whole* model's names and
    global shapes (the same check on every rank), then DCP reads what each rank holds.
    """
    import torch.distributed.checkpoint as dcp

    from shardforge.checkpoint_dcp import COMMIT_MARKER, checkpoint_tensor_shapes

    assert engine.pipeline is not None
    checkpointer.wait()
    if step == "latest":
        latest = checkpointer.latest_step()
        if latest is None:
            return None
        step = latest
    path = checkpointer.path(int(step))
    if not (path / COMMIT_MARKER).is_file():
        raise FileNotFoundError(f"no committed checkpoint for step {step} under {path.parent}")
    prefix = "train.model."
    saved = {k[len(prefix) :]: s for k, s in checkpoint_tensor_shapes(path).items() if k.startswith(prefix)}
    expected = {k: shape for k, (shape, _) in engine.pipeline.tensor_meta.items()}
    if saved != expected:
        missing = sorted(set(expected) - set(saved))[:10]
        unexpected = sorted(set(saved) - set(expected))[:10]
        shapes = sorted(k for k in set(saved) & set(expected) if saved[k] != expected[k])[:10]
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}, "
            f"shape mismatch {shapes}; load a checkpoint saved from the same model architecture (layout may differ)"
        )
    state = engine.train_state()
    dcp.load({"train": state}, storage_reader=dcp.FileSystemReader(str(path)))
    engine.step = state.step
    return state.data_state
