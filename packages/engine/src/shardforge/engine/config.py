"""Engine configuration (frozen, keyword-only dataclasses, one docstring per field)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shardforge.lora import LoRAConfig
from shardforge.mesh import parse_dtype

__all__ = ["EngineConfig", "OptimizerConfig", "SchedulerConfig", "parse_dtype"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW with decoupled weight decay on matrices only."""

    name: Literal["adamw", "anyprecision_adamw"] = "adamw"
    """adamw: torch AdamW (state in the parameter dtype). anyprecision_adamw: `shardforge.memory.AnyPrecisionAdamW`
    (moments in ``state_dtype``; with ``kahan_summation`` a compensation buffer makes bf16 parameters
    (param_dtype="bfloat16") train like fp32 master weights at half the bytes)."""
    state_dtype: str = "bfloat16"
    """anyprecision_adamw: dtype of both Adam moments."""
    kahan_summation: bool | None = None
    """anyprecision_adamw: keep a bf16 Kahan compensation buffer per parameter; None = only when the
    parameters are bf16/fp16 (with fp32 parameters it costs 2 bytes per parameter for nothing)."""
    lr: float = 1e-4
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Weight decay for parameters with >= 2 dims (biases and norm weights never decay)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value (None = no clipping)."""
    fused: bool | None = None
    """One fused kernel per update instead of an eager per-parameter loop: torch AdamW's
    ``fused=True``, AnyPrecisionAdamW's compiled update. None = adamw: fused for floating-point
    parameters on CPU or CUDA, on every layout alike (its rounding does not depend on how a tensor is
    sharded, so layouts still match each other; 4x faster than the loop on CPU); anyprecision_adamw: on
    CUDA only (on an H100 the eager loop was half of a 1B model's step). False = the eager
    per-parameter loop (``foreach=False``), whose rounding differs from fused by ~1 ulp."""

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "anyprecision_adamw"):
            raise ValueError(f"unknown optimizer {self.name!r}; valid: ['adamw', 'anyprecision_adamw']")
        parse_dtype(self.state_dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warmup."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to the peak LR."""
    total_steps: int = 1
    """Steps over which linear/cosine decay to min_lr_ratio * lr."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of the peak LR."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How `TrainEngine` builds and steps the model."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    param_dtype: str = "float32"
    """Dtype of the stored (master) parameters."""
    compute_dtype: str | None = None
    """FSDP mixed-precision compute dtype (e.g. "bf16"); None = param_dtype."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one micro-batch (forward/backward unit)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute decoder-layer activations in backward."""
    checkpoint_every: int = 2
    """For selective activation checkpointing: every k-th layer."""
    tiled_mlp_shards: int = 1
    """Compute each dense decoder MLP in this many sequence chunks, recomputing each chunk in backward, so
    the [tokens, intermediate] activation never exists for the whole micro-batch (1 = off). See
    `shardforge.memory.apply_tiled_mlp`; not with tensor parallel + sequence_parallel."""
    sequence_parallel: bool = True
    """With tp > 1: shard activations on the sequence dim between blocks (Megatron SP)."""
    moe_aux_loss_weight: float | None = None
    """MoE models: weight of the global load-balancing loss; None = the HF config's router_aux_loss_coef."""
    router_replay: bool = False
    """MoE models: route each token of a batch that carries the rollout's recorded experts
    (``extras["routed_experts"]``) to those experts (R3; the RL trainers record them on the embedded
    HF engine). Not with cp > 1 or pp > 1."""
    data_parallel: Literal["fsdp", "ddp"] = "fsdp"
    """How a layout that only replicates (``r`` > 1 with d = c = t = p = e = 1, e.g. ``r2``) holds the
    model. fsdp: parameters sharded over the replicas (least memory). ddp: a full copy per rank and
    gradients all-reduced in buckets overlapped with backward (torch DDP; fastest when the model's
    state fits one device, because FSDP's per-layer all-gathers cost more than a small model's math).
    Other layouts always use FSDP/HSDP."""
    reshard_after_forward: bool = True
    """FSDP: free gathered params after forward (False: keep them until backward, ZeRO-2 like: less
    communication, more memory; the last unit never reshards)."""
    share_prefixes: bool | None = None
    """Hold a prefix that consecutive sequences share (GRPO's group samples of one prompt, DPO pairs, a common
    system prompt; not training targets) once per micro-batch: those tokens run through the model once, not
    once per sequence; outputs and gradients are the unshared ones up to float summation order. None (auto):
    on for dense text models without CP/PP/sliding windows, off on CUDA (the flash varlen kernel takes no
    prefixes). See `shardforge.engine.batching.prefix_sharing`."""
    fsdp_layers_per_unit: int = 1
    """FSDP: consecutive decoder layers per unit (fewer, larger all-gathers and reduce-scatters)."""
    fsdp_forward_prefetch: int = 0
    """FSDP: units whose all-gather is issued ahead in forward and backward (0 = FSDP2's defaults)."""
    cpu_offload: bool = False
    """FSDP: keep params/grads/optimizer state on CPU."""
    offload_when_idle: bool = False
    """Keep weights and optimizer state in host memory between `forward` / `train_batch` calls and move
    them to the device for each call (a reference or critic model that the actor's memory needs between
    uses). A no-op on CPU-only machines. Exclusive with cpu_offload (which never puts them on the device)."""
    pp_schedule: str = "1F1B"
    """With pp > 1: GPipe, 1F1B, Interleaved1F1B or ZBVZeroBubble (torch.distributed.pipelining)."""
    pp_stages_per_rank: int | None = None
    """With pp > 1: (virtual) stages per rank; None = 1, or 2 for Interleaved1F1B / ZBVZeroBubble."""
    pp_layers_per_stage: int | tuple[int, ...] | None = None
    """With pp > 1: decoder layers per stage (one count, or one per stage); None = balanced."""
    pp_num_microbatches: int | None = None
    """With pp > 1: at least this many micro-batches per step (None = pp x stages per rank); each is
    padded to max_tokens_per_microbatch tokens (pipelining needs one static shape)."""
    seed: int = 0
    """Seed for weights initialised from a config (not from a checkpoint), and for a new value head."""
    head: Literal["lm", "value"] = "lm"
    """lm: the causal LM (log-probs). value: the decoder with a scalar head (critic / reward model;
    loss functions get per-position values [T]); see `shardforge.engine.heads`."""
    dist_timeout_s: float = 600.0
    """Collective timeout: a hang becomes an error after this many seconds."""
    freeze_module_prefix: tuple[str, ...] = ()
    """Qualified module names whose parameters do not train (e.g. ``[model.visual]``, a VLM's vision
    tower): no gradient, no optimizer state, no gradient communication. A prefix that matches no
    parameter is an error that lists the model's module names."""
    lora: LoRAConfig | None = None
    """LoRA adapters (only they train; checkpoints hold only them); None = full fine-tuning.
    CLI: ``engine.lora.r=8 engine.lora.target_modules=[q_proj,v_proj]``. See docs/packages/lora.md."""

    def __post_init__(self) -> None:
        if self.head not in ("lm", "value"):
            raise ValueError(f"unknown engine head {self.head!r}; valid: ['lm', 'value']")
        if isinstance(self.tiled_mlp_shards, bool) or self.tiled_mlp_shards < 1:
            raise ValueError(f"tiled_mlp_shards={self.tiled_mlp_shards!r} must be an int >= 1 (1 = off)")
        if self.data_parallel not in ("fsdp", "ddp"):
            raise ValueError(f"unknown data_parallel {self.data_parallel!r}; valid: ['fsdp', 'ddp']")
        if isinstance(self.freeze_module_prefix, str):
            raise ValueError(
                f"freeze_module_prefix must be a list of module names, got the string {self.freeze_module_prefix!r}; "
                f"write [{self.freeze_module_prefix}]"
            )
        if self.offload_when_idle and self.cpu_offload:
            raise ValueError(
                "offload_when_idle and cpu_offload are exclusive: cpu_offload already keeps weights, grads and "
                "optimizer state on the host for the whole run; pick one"
            )
