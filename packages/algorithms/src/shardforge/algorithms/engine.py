"""`TrainEngine`: one HF causal LM, sharded per a `ParallelDims`, trained on packed batches.

The engine is the only place that knows the order parallelisms are applied in
(TP -> CP attention -> EP -> PP -> activation checkpointing -> FSDP/HSDP); today it
composes packed attention, activation checkpointing and FSDP/HSDP.

Loss normalisation: ``loss_fn`` returns a *sum* over a micro-batch; the engine divides by
the loss weight summed over the whole global batch (all micro-batches, all data-parallel
ranks), and multiplies by the number of ranks FSDP averages gradients over. The update
is therefore the same whatever the micro-batching or the world size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.algorithms import lora_support, pipeline_support, value_model
from shardforge.algorithms.batching import (
    SEQUENCE_GROUP,
    PackedBatch,
    grouped_microbatches,
    pad_to_multiple,
    sequence_start_mask,
    split_microbatches,
)
from shardforge.algorithms.config import EngineConfig, parse_dtype
from shardforge.algorithms.engine_io import EngineIO
from shardforge.algorithms.modeling import load_hf_config, materialize_reference, validate_layout
from shardforge.algorithms.moe_support import (
    apply_moe,
    aux_term,
    moe_stats,
    moe_training,
    recording,
    register_moe_checkpoint_hooks,
    reload_expert_tp,
    shard_experts,
)
from shardforge.algorithms.objectives.sft import sft_loss, token_count
from shardforge.algorithms.offload import OffloadState, offloaded_between_calls
from shardforge.algorithms.optim import build_optimizer, build_scheduler
from shardforge.fsdp_wrap import (
    ActivationCheckpointConfig,
    FSDPConfig,
    apply_activation_checkpointing,
    apply_fsdp,
    clip_grad_norm_,
    load_full_state_dict,
    total_grad_norm,
)
from shardforge.memory import apply_tiled_mlp
from shardforge.mesh import ParallelDims, ParallelMesh, build_mesh, current_device, init_distributed
from shardforge.tensor_parallel import apply_tensor_parallel, vocab_parallel_entropy, vocab_parallel_logprobs
from shardforge.ulysses_cp import gather_sequence, packed_model_kwargs, register_packed_attention, slice_for_rank

__all__ = ["LossFn", "LossWeightFn", "TrainEngine"]

LossFn = Callable[[torch.Tensor, PackedBatch], torch.Tensor]
"""(target log-probs [T], micro-batch) -> summed loss (0-dim); a value-head engine passes
per-position values [T] instead of log-probs. A loss function with a true
``wants_entropy`` attribute is called as ``loss_fn(logprobs, mb, entropy=[T] entropies)``
(differentiable; vocab-parallel under TP, gathered under CP)."""
LossWeightFn = Callable[[PackedBatch], torch.Tensor]
"""micro-batch -> its weight in the global normalisation (e.g. number of target tokens)."""


class TrainEngine(EngineIO):
    """Build, shard and train an HF causal LM.

    Args:
        model: an HF model directory (``save_pretrained`` output) or a `PretrainedConfig`
            (weights initialised with ``config.seed``, identically on any layout).
        dims: the parallel layout (`ParallelDims` or a string like ``"d4"`` / ``"r2d2"``).
        config: optimizer, schedule, dtype and memory settings.
    """

    offload_state: OffloadState | None = None
    """Set with ``EngineConfig.offload_when_idle``: weights and optimizer state live on the host between calls."""

    def __init__(
        self,
        model: Any,
        dims: ParallelDims | str = "d-1",
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.hf_config = load_hf_config(model)
        if self.config.head == "value":  # critic / reward model: scalar head (see value_model)
            self.hf_config = value_model.value_hf_config(self.hf_config)
        dims = ParallelDims.parse(dims) if isinstance(dims, str) else dims
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        # Everything that can be wrong with the inputs is checked before the first collective.
        if self.config.head == "value":
            value_model.check_value_layout(dims.pp)
        self.dims = dims.resolve(world)
        validate_layout(self.dims, self.hf_config)
        if self.config.tiled_mlp_shards > 1 and self.dims.tp > 1 and self.config.sequence_parallel:
            raise ValueError(
                "tiled_mlp_shards > 1 with tensor parallel needs sequence_parallel=False (the tiled MLP splits "
                "the sequence itself); or set tiled_mlp_shards=1"
            )
        if self.dims.pp > 1:
            pipeline_support.validate_pipeline(self.dims, self.hf_config, self.config)
        lora_support.validate_lora(self.config, self.dims.pp)
        self.param_dtype = parse_dtype(self.config.param_dtype)
        compute = self.config.compute_dtype
        self.compute_dtype = parse_dtype(compute) if compute else None
        self.mesh: ParallelMesh | None = None
        if world > 1 or dist.is_initialized():
            init_distributed(timeout_s=self.config.dist_timeout_s)
            self.mesh = build_mesh(self.dims)
        self.device = current_device()
        self.pipeline: pipeline_support.EnginePipeline | None = None  # set when pp > 1
        self.model = self._build_model(model)
        self.moe = moe_training(self)  # router recording + load-balancing loss (MoE models only)
        self.optimizer = build_optimizer(self.model, self.config.optimizer)
        register_moe_checkpoint_hooks(self.model, self.optimizer)  # expert-TP optimizer states in DCP
        self.scheduler = build_scheduler(self.optimizer, self.config.scheduler)
        if self.config.offload_when_idle:  # weights + optimizer state on the host between calls
            self.offload_state = OffloadState(self.model, self.optimizer, self.device)
            self.offload_state.offload()
        self.step = 0
        self.logprob_temperature = 1.0
        """Log-probs and entropies are those of softmax(logits / T): RL trainers set T to the
        rollout temperature so ratios compare the same distribution the samples came from."""

    # ------------------------------------------------------------------ construction
    def _build_model(self, source: Any) -> nn.Module:
        attn = register_packed_attention()
        is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
        reference = None
        if is_rank0:
            materialize = value_model.materialize_value_model if self.config.head == "value" else materialize_reference
            reference = materialize(
                source, self.hf_config, dtype=self.param_dtype, attn_implementation=attn, seed=self.config.seed
            )
            reference.config.use_cache = False
            lora_support.add_adapters(reference, self.config)  # adapter init travels in the broadcast
        if self.mesh is None or self.dims.world_size == 1:
            assert reference is not None
            apply_moe(reference, self.dims, None)
            self._tile_mlps(reference)
            apply_activation_checkpointing(reference, self._ac_config())
            return reference.to(self.device)
        with torch.device("meta"):
            model_cls = value_model.model_class(self.config.head)
            model = model_cls.from_config(self.hf_config, dtype=self.param_dtype, attn_implementation=attn)
        model.config.use_cache = False
        lora_support.add_adapters(model, self.config)
        if self.dims.tp > 1:
            sp = self.config.sequence_parallel
            plan = value_model.value_tp_plan(model, sequence_parallel=sp) if self.config.head == "value" else None
            plan = lora_support.tp_plan(model, plan, self.config)
            apply_tensor_parallel(model, self.mesh.get("tp"), plan=plan, sequence_parallel=sp)
        efsdp_mesh = apply_moe(model, self.dims, self.mesh)  # EP / expert TP (MoE models only)
        self._tile_mlps(model)
        if self.dims.pp > 1:  # split into this rank's stages, then AC and FSDP per stage
            return pipeline_support.build_pipeline_model(self, model, reference)
        apply_activation_checkpointing(model, self._ac_config())
        shard_experts(model, efsdp_mesh, self.dims, self._fsdp_config())  # experts over efsdp, first
        fsdp_mesh = self._fsdp_mesh()
        if fsdp_mesh is not None:
            apply_fsdp(model, fsdp_mesh, self._fsdp_config())
        full = reference.state_dict() if reference is not None else None
        buffers = dict(reference.named_buffers()) if reference is not None else None
        load_full_state_dict(model, full, device=self.device, buffers=buffers)
        reload_expert_tp(model, full)  # expert-TP shards are row ranges the generic load misplaces
        del reference, full, buffers
        return model

    def _tile_mlps(self, model: nn.Module) -> None:
        if self.config.tiled_mlp_shards > 1:
            apply_tiled_mlp(model, self.config.tiled_mlp_shards)

    def _ac_config(self) -> ActivationCheckpointConfig:
        return ActivationCheckpointConfig(mode=self.config.activation_checkpointing, every=self.config.checkpoint_every)

    def _fsdp_config(self) -> FSDPConfig:
        return FSDPConfig(
            param_dtype=self.compute_dtype,
            reduce_dtype=torch.float32,
            reshard_after_forward=self.config.reshard_after_forward,
            cpu_offload=self.config.cpu_offload,
        )

    def _fsdp_mesh(self) -> Any | None:
        assert self.mesh is not None
        if self.mesh.has("dp_replicate") and self.mesh.has("fsdp"):
            return self.mesh.get(("dp_replicate", "fsdp"))
        if self.mesh.has("fsdp"):
            return self.mesh.get("fsdp")
        if self.mesh.has("dp_replicate"):
            # Replicate-only layouts (r>1, d=1) shard over the replicas: numerically the same
            # as DDP, with less memory.
            return self.mesh.get("dp_replicate")
        return None  # no data-parallel axis (e.g. pure TP): nothing to shard

    # ------------------------------------------------------------------ groups
    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Ranks holding different data (losses and weights are summed over them)."""
        if self.mesh is None or not self.mesh.has("dp"):
            return None
        return self.mesh.get("dp").get_group()

    @property
    def dp_rank(self) -> int:
        return self.mesh.local_rank("dp") if self.mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def is_main(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def _all_reduce_sum(self, *values: torch.Tensor | float, group: dist.ProcessGroup | None) -> list[float]:
        """Sum scalars over ``group`` in one collective (float64); identity without a group."""
        packed = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if group is not None:
            packed = packed.to(self.device)
            dist.all_reduce(packed, group=group)
        return packed.cpu().tolist()  # type: ignore[no-any-return]

    def _microbatches(self, batch: PackedBatch) -> list[tuple[list[int], PackedBatch | None]]:
        group = dist.group.WORLD if dist.is_initialized() else None
        if SEQUENCE_GROUP in batch.extras:  # keep groups (e.g. chosen/rejected pairs) in one micro-batch
            return grouped_microbatches(batch, self.config.max_tokens_per_microbatch, group=group)
        return split_microbatches(batch, self.config.max_tokens_per_microbatch, group=group)

    # ------------------------------------------------------------------ compute
    @property
    def _token_multiple(self) -> int:
        """Packed lengths must be a multiple of this: cp splits the sequence, and so does
        tensor-parallel sequence parallelism within each CP chunk."""
        sp = self.dims.tp if self.dims.tp > 1 and self.config.sequence_parallel else 1
        return self.dims.cp * sp

    @property
    def _cp_group(self) -> dist.ProcessGroup | None:
        if self.mesh is None or not self.mesh.has("cp"):
            return None
        return self.mesh.get("cp").get_group()

    def _logprobs(self, mb: PackedBatch) -> torch.Tensor:
        return self._logprobs_entropy(mb, entropy=False)[0]

    def _logprobs_entropy(self, mb: PackedBatch, *, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T] target log-probs and, if asked, [T] entropy of the distribution each target was
        drawn from (same alignment: entry t belongs to token t; 0 at sequence starts).
        Value-head engines return [T] per-position values instead (`value_model.forward_values`)."""
        if self.config.head == "value":
            if entropy:
                raise ValueError("a value-head engine has no token distribution: its loss_fn cannot want entropy")
            return value_model.forward_values(self, mb), None
        num_tokens = mb.num_tokens
        padded = pad_to_multiple(mb, self._token_multiple).to(self.device)
        # Next-token targets come from the full sequence, before any CP slicing.
        targets = torch.roll(padded.input_ids, -1)
        input_ids, position_ids = padded.input_ids, padded.position_ids
        cp_group = self._cp_group
        if cp_group is not None:
            rank, cp = self.mesh.local_rank("cp"), self.dims.cp  # type: ignore[union-attr]
            input_ids, position_ids, targets = (slice_for_rank(x, rank, cp) for x in (input_ids, position_ids, targets))
        out = self.model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            use_cache=False,
            **packed_model_kwargs(padded.cu_seqlens, cp_group=cp_group),
        )
        logits = out.logits[0]
        if self.logprob_temperature != 1.0:  # the sampling distribution of RL rollouts
            logits = logits / self.logprob_temperature
        if isinstance(logits, DTensor):
            # Vocab-sharded logits (tensor parallel): never gathered to full vocab.
            next_logprobs = vocab_parallel_logprobs(logits, targets)
        else:
            next_logprobs = -F.cross_entropy(logits.float(), targets, reduction="none")
        starts = sequence_start_mask(padded.cu_seqlens, padded.num_tokens)

        def realign(per_position: torch.Tensor) -> torch.Tensor:
            # Gather CP chunks back to the whole sequence (autograd: each rank keeps its chunk's grad).
            whole = gather_sequence(per_position, cp_group)
            # Position t predicted token t+1; re-align so entry t belongs to token t.
            shifted = torch.cat([whole.new_zeros(1), whole[:-1]]).masked_fill(starts, 0.0)
            return shifted[:num_tokens]

        entropies = None
        if entropy:
            if isinstance(logits, DTensor):
                entropies = vocab_parallel_entropy(logits)
            else:
                log_p = F.log_softmax(logits.float(), dim=-1)
                entropies = -(log_p.exp() * log_p).sum(-1)
            entropies = realign(entropies)
        return realign(next_logprobs), entropies

    def _dummy(self) -> PackedBatch:
        # Ranks with fewer sequences than the agreed micro-batch count still run forward and
        # backward (FSDP collectives must match) on one token with zero loss weight.
        return PackedBatch(
            input_ids=torch.zeros(1, dtype=torch.long),
            position_ids=torch.zeros(1, dtype=torch.long),
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
            loss_mask=torch.zeros(1),
        )

    @offloaded_between_calls
    def train_batch(
        self,
        batch: PackedBatch,
        loss_fn: LossFn = sft_loss,
        loss_weight_fn: LossWeightFn = token_count,
    ) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; return global stats."""
        wants_entropy = bool(getattr(loss_fn, "wants_entropy", False))
        if self.pipeline is not None:
            if wants_entropy:
                raise NotImplementedError(
                    "entropy-aware losses (loss_fn.wants_entropy) are not supported with pp > 1 yet"
                )
            return pipeline_support.pp_train_batch(self, batch, loss_fn, loss_weight_fn)
        start = time.perf_counter()
        self.model.train()
        microbatches = self._microbatches(batch)
        local_weight = sum(
            (loss_weight_fn(mb).detach().double() for _, mb in microbatches if mb is not None),
            torch.zeros((), dtype=torch.float64),
        )
        [global_weight] = self._all_reduce_sum(local_weight, group=self.dp_group)
        if global_weight <= 0:
            raise ValueError(
                "the global batch has zero loss weight (no target tokens on any rank); check loss_mask "
                "(e.g. completions are empty or were truncated away)"
            )
        # FSDP averages gradients over the dp_cp ranks; undo that so the sum is global.
        grad_scale = self.dims.dp_cp / global_weight
        loss_sum = torch.zeros((), dtype=torch.float64)
        for _, mb in microbatches:
            real = mb is not None
            mb = (mb if mb is not None else self._dummy()).to(self.device)
            with recording(self.moe, mb.num_tokens, real):
                logprobs, entropy = self._logprobs_entropy(mb, entropy=wants_entropy)
            loss = loss_fn(logprobs, mb, entropy=entropy) if wants_entropy else loss_fn(logprobs, mb)  # type: ignore[call-arg]
            if not real:
                loss = loss * 0.0
            (loss * grad_scale + aux_term(self.moe, len(microbatches))).backward()
            loss_sum += loss.detach().double().cpu()
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.config.optimizer.max_grad_norm
        grad_norm = clip_grad_norm_(params, max_norm) if max_norm else total_grad_norm(params)
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        loss_total, num_tokens = self._all_reduce_sum(loss_sum, batch.num_tokens, group=self.dp_group)
        total_loss = loss_total / global_weight
        return {
            "loss": total_loss,
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "loss_weight": global_weight,
            "tokens": num_tokens,
            "microbatches": float(len(microbatches)),
            "skipped": float(not finite),
            "step_time_s": time.perf_counter() - start,
            **moe_stats(self.moe),
        }

    @torch.no_grad()
    @offloaded_between_calls
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """[T] target log-probs of this rank's batch (token order of ``batch``); value-head engines
        return [T] per-position values."""
        if self.pipeline is not None:
            return pipeline_support.pp_forward(self, batch)
        self.model.eval()
        out = torch.zeros(batch.num_tokens, dtype=torch.float32)
        bounds = batch.cu_seqlens.tolist()
        for indices, mb in self._microbatches(batch):
            logprobs = self._logprobs(mb if mb is not None else self._dummy()).cpu()
            if mb is None:
                continue
            offset = 0
            for i in indices:
                length = bounds[i + 1] - bounds[i]
                out[bounds[i] : bounds[i + 1]] = logprobs[offset : offset + length]
                offset += length
        return out

    @torch.no_grad()
    @offloaded_between_calls
    def eval_batch(
        self,
        batch: PackedBatch,
        loss_fn: LossFn = sft_loss,
        loss_weight_fn: LossWeightFn = token_count,
    ) -> dict[str, float]:
        """Global loss of a batch without updating anything."""
        if self.pipeline is not None:
            return pipeline_support.pp_eval_batch(self, batch, loss_fn, loss_weight_fn)
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64)
        weight = torch.zeros((), dtype=torch.float64)
        for _, mb in self._microbatches(batch):
            logprobs = self._logprobs(mb if mb is not None else self._dummy())
            if mb is None:
                continue
            loss_sum += loss_fn(logprobs, mb.to(self.device)).double().cpu()
            weight += loss_weight_fn(mb).double()
        total, weight_total = self._all_reduce_sum(loss_sum, weight, group=self.dp_group)
        return {"loss": total / max(weight_total, 1e-12), "loss_weight": weight_total}
