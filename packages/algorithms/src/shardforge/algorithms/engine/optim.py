"""AdamW with weight-decay groups and warmup + constant/linear/cosine schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardforge.algorithms.engine.config import OptimizerConfig, SchedulerConfig, parse_dtype
from shardforge.memory import AnyPrecisionAdamW

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW (torch's or `AnyPrecisionAdamW`) over trainable params; matrices decay, vectors (biases,
    norms) do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if config.name == "anyprecision_adamw":
        dtype = parse_dtype(config.state_dtype)
        kahan = config.kahan_summation
        if kahan is None:  # compensation only helps weights that round the update away
            kahan = any(p.dtype in (torch.bfloat16, torch.float16) for p in decay + no_decay)
        return AnyPrecisionAdamW(
            [g for g in groups if g["params"]],
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            momentum_dtype=dtype,
            variance_dtype=dtype,
            compensation_buffer_dtype=torch.bfloat16,
            use_kahan_summation=kahan,
            fused=config.fused,
        )
    params = decay + no_decay
    fused = config.fused if config.fused is not None else bool(params) and all(p.is_cuda for p in params)
    # Not fused: foreach=False, the plain loop, as fast as foreach on CPU and bit-identical across layouts.
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        **({"fused": True} if fused else {"foreach": False}),
    )


def lr_factor(step: int, config: SchedulerConfig) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    if config.warmup_steps > 0 and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.kind == "constant":
        return 1.0
    decay_steps = max(config.total_steps - config.warmup_steps, 1)
    progress = min(max(step - config.warmup_steps, 0) / decay_steps, 1.0)
    floor = config.min_lr_ratio
    if config.kind == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if config.kind == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown scheduler kind {config.kind!r}; valid: 'constant', 'linear', 'cosine'")


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` following `lr_factor` (stateful: resumes with the optimizer)."""
    if config.kind not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown scheduler kind {config.kind!r}; valid: 'constant', 'linear', 'cosine'")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
