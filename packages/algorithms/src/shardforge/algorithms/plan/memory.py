"""Per-rank peak memory of one training step for a layout: the planner's memory model.

The peak is the largest of three moments of a step (each a sum of what is alive then):

* ``logits``: start of backward on the last pipeline stage. Every layer's saved
  activations (times the micro-batches in flight), the loss working set, and the FSDP
  units still gathered (lm_head, the last layer, the root).
* ``layer``: a decoder layer's backward (every layer of the rank is tried). Saved activations
  of the layers not yet done, the layer's backward working set (recomputation under
  activation checkpointing), the gradients of what already ran (lm_head, final norm, later
  layers), two gathered layers (the current one and the prefetched next) and the
  reduce-scatter buffers of its gradients.
* ``optimizer``: params + grads + optimizer state + the update's temporaries.

Parameters and optimizer state are always alive; gradients only from the first backward
on (so at ``logits`` only when several micro-batches accumulate). docs/planner.md lists
every formula.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from shardforge.algorithms.plan.activations import ActivationModel
from shardforge.algorithms.plan.options import PlanOptions, dtype_bytes, is_frozen
from shardforge.algorithms.plan.shards import ShardPlan, shard_plan
from shardforge.algorithms.plan.stats import ModelStats, ParamInfo
from shardforge.algorithms.plan.vision import vision_terms
from shardforge.mesh import ParallelDims

__all__ = ["MemoryEstimate", "estimate_memory"]


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Predicted per-rank peak (bytes) of the worst rank of a layout, split by what holds it."""

    dims: ParallelDims
    params: int
    grads: int
    """Gradients alive at the peak (0 at a backward-start peak with one micro-batch per step)."""
    optim: int
    activations: int
    comm: int
    """Gathered FSDP units and reduce-scatter buffers alive at the peak."""
    total: int
    phase: str
    """logits | layer | vision (an image-text model's vision-tower backward) | optimizer: which moment of the step is
    the peak."""
    pp_rank: int
    host: int = 0
    """Host bytes (params, grads, optimizer state) under cpu_offload."""
    state: dict[str, int] = field(default_factory=dict)
    """Whole-step sizes on the device: params, grads, optim (grads whether or not alive at the peak)."""
    data_parallel: str = "fsdp"
    """How data parallelism holds the model: "fsdp" (sharded) or "ddp" (a replica per rank; `plan.ddp`)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.dims.to_string(),
            "params": self.params,
            "grads": self.grads,
            "optim": self.optim,
            "activations": self.activations,
            "comm": self.comm,
            "total": self.total,
            "phase": self.phase,
            "pp_rank": self.pp_rank,
            "host": self.host,
            "state": dict(self.state),
            "data_parallel": self.data_parallel,
        }


def _lora_numel(p: ParamInfo, sp: ShardPlan, rank: int) -> tuple[int, int]:
    """(local, gathered) elements of the LoRA A and B of target weight ``p`` [out, in]."""
    out_f, in_f = p.shape
    t = sp.dims.tp if sp.dims.tp > 1 else 1
    if p.tp_dim == 0:  # colwise base: B [out/t, r] sharded, A [r, in] replicated
        a_shape, b_shape = (rank, in_f), (out_f // t, rank)
    else:  # rowwise base: A [r, in/t] sharded, B [out, r] replicated
        a_shape, b_shape = (rank, in_f // t), (out_f, rank)
    gathered = a_shape[0] * a_shape[1] + b_shape[0] * b_shape[1]
    n = sp.fsdp_size
    local = sum(-(-s0 // n) * s1 for s0, s1 in (a_shape, b_shape)) if n > 1 else gathered
    return local, gathered


@dataclass
class _Unit:
    local: int = 0
    gathered: int = 0
    trainable_local: int = 0
    trainable_gathered: int = 0
    largest_trainable: int = 0

    def add(self, local: int, gathered: int, trainable: bool) -> None:
        self.local += local
        self.gathered += gathered
        if trainable:
            self.trainable_local += local
            self.trainable_gathered += gathered
            self.largest_trainable = max(self.largest_trainable, local)


def _unit(
    params: tuple[ParamInfo, ...], sp: ShardPlan, opts: PlanOptions, experts: bool | None = None, prefix: str = ""
) -> _Unit:
    unit = _Unit()
    lora = opts.lora_rank > 0
    for p in params:
        if experts is not None and p.expert != experts:
            continue
        frozen = is_frozen(prefix + p.name, opts.frozen_prefixes)
        unit.add(sp.local_numel(p), sp.gathered_numel(p), trainable=not lora and not frozen)
        if lora and p.lora_target in opts.lora_targets and len(p.shape) == 2:
            unit.add(*_lora_numel(p, sp, opts.lora_rank), trainable=True)
    return unit


def _stage_layout(stats: ModelStats, dims: ParallelDims, opts: PlanOptions) -> list[tuple[list[int], bool, bool]]:
    """Per pp rank: (global layer indices, holds the embedding, holds the head)."""
    if dims.pp == 1:
        return [(list(range(stats.num_layers)), True, True)]
    from shardforge.pipeline import resolve_schedule, split_layers, stage_ids_for_rank

    spec = resolve_schedule(opts.pp_schedule)
    v = spec.default_stages_per_rank
    ranges = split_layers(stats.num_layers, dims.pp * v)
    out = []
    for rank in range(dims.pp):
        ids = stage_ids_for_rank(rank, dims.pp, v, spec.style)
        layers = [i for s in ids for i in ranges[s]]
        out.append((layers, 0 in ids, dims.pp * v - 1 in ids))
    return out


def _in_flight(dims: ParallelDims, opts: PlanOptions, pp_rank: int) -> float:
    """Micro-batches whose activations a pp rank holds at once (1 without pipelining)."""
    if dims.pp == 1:
        return 1.0
    from shardforge.pipeline import resolve_schedule

    spec = resolve_schedule(opts.pp_schedule)
    v = spec.default_stages_per_rank
    m = max(opts.num_microbatches, dims.pp * v)
    if spec.name == "GPipe":
        return float(m)
    if spec.name == "1F1B":
        return float(min(m, dims.pp - pp_rank))
    # Interleaved 1F1B: (v-1) pp + 2 (pp - r - 1) + 1 warm-up chunks of 1/v of the rank's layers;
    # ZB-V is taken the same way (an approximation).
    chunks = (v - 1) * dims.pp + 2 * (dims.pp - pp_rank - 1) + 1
    return min(m * v, chunks) / v


def estimate_memory(stats: ModelStats, dims: ParallelDims, opts: PlanOptions) -> MemoryEstimate:
    """Predict the per-rank peak of ``dims`` (resolved); the worst pipeline rank when pp > 1."""
    sp = shard_plan(stats, dims)
    pb = dtype_bytes(opts.param_dtype)
    a = dtype_bytes(opts.compute_dtype) if (sp.fsdp and opts.compute_dtype) else pb
    if opts.optimizer == "anyprecision_adamw":
        # bf16 exp_avg + exp_avg_sq, + a bf16 Kahan compensation buffer for 16-bit params (the engine's default)
        grad_b, optim_b = pb, 4 + (2 if pb == 2 else 0)
    else:
        grad_b, optim_b = pb, 2 * pb  # torch AdamW: moments like the param
    multiple = dims.cp * (dims.tp if dims.tp > 1 and opts.sequence_parallel else 1)
    tokens = opts.micro_batch_tokens if dims.pp > 1 else max(opts.micro_batch_tokens, opts.seq_len)
    tokens = -(-tokens // multiple) * multiple
    t_local = tokens // dims.cp
    act = ActivationModel(
        stats,
        a=a,
        tp=dims.tp,
        cp=dims.cp,
        sequence_parallel=opts.sequence_parallel,
        attention=opts.attention,
        expert_tp=sp.expert_tp,
        tiled_mlp_shards=opts.tiled_mlp_shards,
        lora_rank=opts.lora_rank,
        lora_targets=opts.lora_targets,
    )
    layer_units = [_unit(spec.params, sp, opts) for spec in stats.layer_specs]
    expert_units = [_unit(spec.params, sp, opts, experts=True) for spec in stats.layer_specs]
    experts_own_unit = dims.ep > 1
    embed, head, root = (_unit(x, sp, opts) for x in (stats.embedding, stats.lm_head, stats.root))
    vision = vision_terms(stats, sp, opts, a) if stats.vision is not None else None
    inside = [f for f in opts.frozen_prefixes if re.match(r"^model\.(language_model\.)?layers(\.|$)", f)]
    if inside:
        raise ValueError(
            f"frozen_prefixes {inside} reach into decoder layers, which the planner does not model frozen; "
            "it models frozen vision towers, embeddings and lm_head (e.g. model.visual)"
        )
    every = 1 if opts.activation_checkpointing == "full" else opts.checkpoint_every
    packed = opts.micro_batch_tokens > opts.seq_len  # several sequences share a micro-batch
    live = [act.base_trainable]  # whether each layer's input requires grad (not layer 0's under LoRA)
    for kind in stats.layer_kind:
        live.append(act.layer_live_out(stats.layer_specs[kind], live[-1]))
    terms: dict[tuple[int, bool, bool], tuple[float, float]] = {}

    def layer_terms(index: int, live_in: bool) -> tuple[float, float]:
        """(saved, backward working set) per token of layer ``index``; identical layers share them."""
        ckpt = opts.activation_checkpointing != "none" and index % every == 0
        key = (stats.layer_kind[index], ckpt, live_in)
        if key not in terms:
            spec = stats.layer_specs[key[0]]
            terms[key] = (act.layer_saved(spec, ckpt, live_in), act.layer_backward_work(spec, ckpt, live_in))
        return terms[key]

    best: MemoryEstimate | None = None
    for pp_rank, (layers, has_embed, has_head) in enumerate(_stage_layout(stats, dims, opts)):
        units = [layer_units[stats.layer_kind[i]] for i in layers]
        units += [u for u, present in ((embed, has_embed), (head, has_head), (root, has_head)) if present]
        local = sum(u.local for u in units)
        trainable = sum(u.trainable_local for u in units)
        if vision is not None and has_embed:  # the vision tower runs where the embedding does
            local, trainable = local + vision.local, trainable + vision.trainable_local
        params, grads, optim = local * pb, trainable * grad_b, trainable * optim_b
        host = 0
        if opts.cpu_offload and sp.fsdp:
            host, params, grads, optim = params + grads + optim, 0, 0, 0
        carry = grads if (opts.num_microbatches > 1 or dims.pp > 1) else 0
        in_flight = _in_flight(dims, opts, pp_rank)

        def checkpointed(index: int) -> bool:
            return opts.activation_checkpointing != "none" and index % every == 0

        lives = [live[i] for i in layers]
        per_layer = [layer_terms(i, live[i])[0] for i in layers]
        saved = sum(per_layer) + (act.rope() if layers else 0)
        saved_bytes = in_flight * t_local * saved
        # A trained vision tower's activations live from its forward (first) to its backward (last).
        saved_bytes += vision.saved_bytes if vision is not None and has_embed else 0.0
        # Checkpointed layers keep their kwargs until their backward: the bool attention mask HF builds for
        # packed sequences (several per micro-batch), [Tr / s, Tr / s] (its length is the embedding output's,
        # sequence-sharded under SP), is alive from forward to the last one.
        if dims.pp == 1 and any(checkpointed(i) for i in layers) and packed:
            saved_bytes += float(t_local // act.s) ** 2
        # FSDP-gathered units (compute dtype) and reduce-scatter buffers.
        keep_all = sp.fsdp and (dims.pp > 1 or not opts.reshard_after_forward)
        if not sp.fsdp:
            gathered_head = gathered_layer = 0.0
        elif keep_all:
            gathered_head = gathered_layer = a * sum(u.gathered for u in units)
        else:
            # One FSDP unit holds fsdp_layers_per_unit layers; the current unit, the one backward
            # prefetches, and fsdp_forward_prefetch more issued ahead in forward are gathered at once.
            big = max((u.gathered for u in units[: len(layers)]), default=0) * min(
                opts.fsdp_layers_per_unit, len(layers) or 1
            )
            gathered_head = a * ((head.gathered + root.gathered) * has_head + (big if layers else 0))
            gathered_layer = a * (2 + opts.fsdp_forward_prefetch) * big
        rs_bytes = 0.0
        if sp.fsdp and layers:
            big_trainable = max(u.trainable_gathered for u in units[: len(layers)])
            rs_bytes = big_trainable * (a + (4 if a != 4 else 0))  # grads in compute dtype + fp32 copy
        if experts_own_unit and sp.fsdp and layers:
            expert_gathered = max(u.gathered for u in expert_units)
            gathered_layer += a * expert_gathered  # experts are a second unit of the layer
        candidates: list[tuple[str, float, float, float]] = []  # (phase, activations, comm, grads)
        if has_head:
            head_act = saved_bytes + t_local * (act.head_saved() + act.logits_peak())
            candidates.append(("logits", head_act, gathered_head, carry))
        # Backward runs the layers last to first: layer j's peak has the saved activations of layers <= j
        # (of this micro-batch; all layers of the others in flight), the gradients of what already ran
        # (lm_head, final norm, layers > j; all of them when they accumulate), and its working set.
        done = sum(u.trainable_local for u, present in ((head, has_head), (root, has_head)) if present)
        done += embed.trainable_local if stats.tied and has_embed and has_head else 0
        grad_elem = grad_b if grads else 0  # no device gradients under cpu_offload
        below = saved_bytes - t_local * sum(per_layer)  # rope, mask and the other micro-batches' layers
        prefix = 0.0
        later = [0] * (len(layers) + 1)  # trainable elements of the layers after j
        for j in reversed(range(len(layers))):
            later[j] = later[j + 1] + units[j].trainable_local
        layer_peaks: list[tuple[float, float]] = []
        for j, (i, lv) in enumerate(zip(layers, lives)):
            prefix += per_layer[j]
            own = 0 if sp.fsdp else units[j].largest_trainable  # the first weight grad of the layer (down_proj)
            work = layer_terms(i, lv)[1]
            layer_peaks.append((below + t_local * (prefix + work), carry or (done + later[j + 1] + own) * grad_elem))
        if layer_peaks:
            layer_act, layer_grads = max(layer_peaks, key=lambda x: x[0] + x[1])
            candidates.append(("layer", layer_act, gathered_layer + rs_bytes, layer_grads))
        if vision is not None and vision.saved_bytes and has_embed:
            # The tower's backward, last: every text gradient exists, the text activations are freed.
            text_grads = carry or (done + later[0] + embed.trainable_local * (not stats.tied)) * grad_elem
            candidates.append(("vision", vision.saved_bytes, 2 * a * vision.gathered_block * sp.fsdp, text_grads))
        largest = max([u.largest_trainable for u in units] + [vision.largest_trainable if vision else 0])
        opt_temp = 0 if opts.cpu_offload and sp.fsdp else 2 * largest * (optim_b // 2)
        candidates.append(("optimizer", float(opt_temp), 0.0, grads))
        for phase, act_b, comm_b, grads_b in candidates:
            total = params + optim + grads_b + act_b + comm_b
            est = MemoryEstimate(
                dims=dims,
                params=int(params),
                grads=int(grads_b),
                optim=int(optim),
                activations=int(act_b),
                comm=int(comm_b),
                total=int(total),
                phase=phase,
                pp_rank=pp_rank,
                host=int(host),
                state={"params": int(params), "grads": int(grads), "optim": int(optim)},
            )
            if best is None or est.total > best.total:
                best = est
    assert best is not None
    return best
