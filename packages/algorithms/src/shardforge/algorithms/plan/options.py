"""What the planner is asked: training options that change memory, and the device budget."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["DTYPE_BYTES", "PlanOptions", "dtype_bytes", "is_frozen", "parse_memory"]

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MEMORY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str | int | float) -> int:
    """``"80GiB"`` -> 85899345920 bytes; also GB (10^9), MiB, MB, plain bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"memory must be positive, got {text}")
        return int(text)
    match = _MEMORY.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot parse memory {text!r}; use a number with a unit, e.g. '80GiB', '24GB', '512MiB' "
            f"(units: {sorted(u for u in _UNITS if u)})"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"memory must be positive, got {text!r}")
    if not unit and value < 2**20:  # "--memory 80" meant 80 GiB, not 80 bytes
        raise ValueError(
            f"memory {text!r} has no unit and is under 1 MiB; write the unit, e.g. '{match.group(1)}GiB' or "
            f"'{match.group(1)}GB'"
        )
    return int(value)


def dtype_bytes(name: str) -> int:
    key = name.lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """Training settings that change per-rank memory (mirrors `EngineConfig` where it exists)."""

    seq_len: int
    """Longest sequence; a micro-batch holds at least one whole sequence."""
    micro_batch_tokens: int
    """The engine's max_tokens_per_microbatch (packed tokens per forward/backward)."""
    num_microbatches: int = 1
    """Micro-batches per optimizer step on each data-parallel rank (> 1: gradients live across them)."""
    param_dtype: str = "bf16"
    """Dtype of the stored (master) parameters."""
    compute_dtype: str | None = None
    """FSDP mixed-precision compute dtype; None = param_dtype. Without an FSDP axis the engine computes
    in param_dtype."""
    optimizer: Literal["adamw", "anyprecision_adamw"] = "adamw"
    """adamw: two moments in the param dtype (fp32 params -> fp32 moments). anyprecision_adamw: bf16
    moments (+ a bf16 Kahan compensation buffer when params are 16-bit): 6 bytes per bf16 param, 4 per fp32."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute decoder layers in backward: every layer (full) or every k-th (selective)."""
    checkpoint_every: int = 2
    """k for selective activation checkpointing."""
    tiled_mlp_shards: int = 1
    """> 1: the MLP runs on sequence chunks with recomputation; its intermediate is never whole."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: sharded params, grads and optimizer state live on the host."""
    lora_rank: int = 0
    """> 0: LoRA adapters of this rank on ``lora_targets``; the base model is frozen."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Linear-layer names that get adapters."""
    sequence_parallel: bool = True
    """With tp > 1: Megatron sequence parallelism between blocks."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (False keeps every unit gathered)."""
    fsdp_layers_per_unit: int = 1
    """FSDP: decoder layers per FSDP unit (one all-gather per unit: bigger gathered buffers)."""
    fsdp_forward_prefetch: int = 0
    """FSDP: units whose all-gather is issued ahead in forward (each holds one more gathered unit)."""
    attention: Literal["flash", "cpu"] = "flash"
    """Attention back-end of the target device: flash varlen (CUDA bf16/fp16) or the CPU block-diagonal
    SDPA (saves gathered q/k/v copies)."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule when pp > 1 (GPipe keeps every micro-batch in flight)."""
    vision_patches: int = 0
    """Image-text models: vision-tower patches per micro-batch on each rank (their merged image tokens are
    part of ``micro_batch_tokens``)."""
    frozen_prefixes: tuple[str, ...] = ()
    """`EngineConfig.freeze_module_prefix`: parameters under these module names get no gradient and no
    optimizer state (the vision tower, the embedding, lm_head; not parts of decoder layers)."""

    def __post_init__(self) -> None:
        if self.fsdp_forward_prefetch < 0:
            raise ValueError(f"fsdp_forward_prefetch={self.fsdp_forward_prefetch} must be >= 0")
        for name in ("seq_len", "micro_batch_tokens", "num_microbatches", "checkpoint_every", "tiled_mlp_shards",
                     "fsdp_layers_per_unit"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.vision_patches < 0:
            raise ValueError(f"vision_patches={self.vision_patches} must be >= 0")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank} must be >= 0")
        if self.optimizer not in ("adamw", "anyprecision_adamw"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; valid: ['adamw', 'anyprecision_adamw']")
        if self.activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r}; valid: 'none', 'full', 'selective'"
            )
        if self.attention not in ("flash", "cpu"):
            raise ValueError(f"attention={self.attention!r}; valid: 'flash', 'cpu'")
        dtype_bytes(self.param_dtype)
        if self.compute_dtype is not None:
            dtype_bytes(self.compute_dtype)


def is_frozen(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the parameter ``name`` lies under one of the module names ``prefixes`` (whole components)."""
    return any(name == f or name.startswith(f + ".") for f in prefixes)
