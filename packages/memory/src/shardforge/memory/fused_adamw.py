"""AnyPrecisionAdamW's update as compiled kernels over many parameters at once (the default on CUDA).

The eager update (`anyprecision._adamw_update_`) runs about fifteen elementwise kernels per
parameter and materialises fp32 copies of the gradient, both moments, the compensation buffer and
the weight. On an H100 that was half of a 1B model's SFT step (88 of 176 ms of CUDA time,
`benchmarks/gpu/bench_step_breakdown.py`). Compiled with ``torch.compile``, the same arithmetic is
one fused kernel that reads each stored tensor once and writes it once, with the fp32 values in
registers.

Tensors are flattened to 1-D and every per-step scalar (step size, bias correction, decay) is a
small tensor on the parameter's device, so one graph serves every parameter size and every step:
no recompilation as the step count or the learning rate changes. The result equals the eager update
up to floating-point reassociation (fp32 math, rounded once when stored), not bit for bit.

One compiled call updates a chunk of up to `CHUNK` parameters (`fused_update_many_`). A call per
parameter cost about 270 us of host time (guards, argument handling) on an H200: 40 ms of a 1B
Llama's 142 ms SFT step (seq 4096), with the GPU idle meanwhile. Chunks of 64 cut the step to
118.5 ms but took 79 s to compile: sizes are symbolic (so the graphs depend only on the chunk's
length and dtypes, not on the model), and tracing costs about 1.2 s more per tensor in a chunk on a
slow host (CPU, aot_eager: chunk 1 2.4 s, 4 6.5 s, 8 11.6 s, 16 18.3 s). `CHUNK = 8` sits between the
measured points (about 19 calls instead of 147 for that model, one graph plus a remainder); it has
not been timed on a GPU yet (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CHUNK", "can_fuse", "fused_update_many_", "scalars"]


_COMPILED: dict[bool, Callable[..., None]] = {}
CHUNK = 8


def _moments(
    g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: torch.Tensor, beta1: float, beta2: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Update and store both moments; return (fp32 first moment, the bias-corrected denominator)."""
    g32 = g.float()
    m32 = torch.lerp(m.float(), g32, 1 - beta1)
    v32 = v.float() * beta2 + g32 * g32 * (1 - beta2)
    m.copy_(m32)
    v.copy_(v32)
    return m32, v32.sqrt() / s[1] + eps


def _kahan(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor,
    beta1: float, beta2: float, eps: float,
) -> None:  # fmt: skip
    m32, denom = _moments(g, m, v, s, beta1, beta2, eps)
    update = c.float() + m32 / denom * s[0] + p.float() * s[2]
    exact = p.float() + update
    p.copy_(exact)
    c.copy_(exact - p.float())


def _plain(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
    beta1: float, beta2: float, eps: float,
) -> None:  # fmt: skip
    m32, denom = _moments(g, m, v, s, beta1, beta2, eps)
    p.copy_(p.float() * s[3] + m32 / denom * s[0])


def _many(
    ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor],
    cs: list[torch.Tensor] | None, s: torch.Tensor, beta1: float, beta2: float, eps: float,
) -> None:  # fmt: skip
    for i in range(len(ps)):
        if cs is None:
            _plain(ps[i], gs[i], ms[i], vs[i], s, beta1, beta2, eps)
        else:
            _kahan(ps[i], gs[i], ms[i], vs[i], cs[i], s, beta1, beta2, eps)


def _compiled(kahan: bool) -> Callable[..., None]:
    """The compiled update of a list of parameters (``kahan`` selects the compensated one)."""
    if kahan not in _COMPILED:
        _COMPILED[kahan] = torch.compile(
            _many,
            dynamic=True,
            fullgraph=True,
            # Keep the rounding to the stored dtype: Kahan's compensation is exactly what it loses
            # (by default inductor keeps a downcast-then-upcast value in fp32).
            options={"emulate_precision_casts": True},
        )
    return _COMPILED[kahan]


def scalars(
    *, step: float, lr: float, beta1: float, beta2: float, weight_decay: float, device: torch.device
) -> torch.Tensor:
    """[-step size, sqrt(bias correction 2), -lr * wd, 1 - lr * wd] in fp32 on ``device``."""
    step_size = lr / (1 - beta1**step)
    values = [-step_size, (1 - beta2**step) ** 0.5, -lr * weight_decay, 1 - lr * weight_decay]
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def can_fuse(*tensors: torch.Tensor | None) -> bool:
    """Contiguous plain tensors on one device (flattening them is then a view)."""
    present = [t for t in tensors if t is not None]
    return all(t.is_contiguous() for t in present) and len({t.device for t in present}) == 1


def fused_update_many_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    compensations: list[torch.Tensor] | None,
    step_scalars: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """The update of `anyprecision._adamw_update_` for parameters sharing one step's scalars (from `scalars`),
    compiled, `CHUNK` parameters per call."""
    compiled = _compiled(compensations is not None)
    for lo in range(0, len(params), CHUNK):
        flat: list[Any] = [
            [t.view(-1) for t in tensors[lo : lo + CHUNK]] for tensors in (params, grads, exp_avgs, exp_avg_sqs)
        ]
        flat.append(None if compensations is None else [t.view(-1) for t in compensations[lo : lo + CHUNK]])
        compiled(*flat, step_scalars, beta1, beta2, eps)
