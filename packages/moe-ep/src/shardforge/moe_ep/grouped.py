"""Local expert compute: one grouped matmul per projection over rows sorted by expert.

Legend: ``N`` rows (token copies routed to this rank's experts, grouped by expert),
``H`` hidden, ``I`` expert intermediate size (per rank under expert TP), ``El`` local experts.

`torch.nn.functional.grouped_mm` (or `torch._grouped_mm`) runs all experts in one kernel
where the device supports it; elsewhere a loop of per-expert matmuls gives the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["expert_mlp", "grouped_linear", "grouped_mm_available"]

_GROUPED_MM: Callable[..., torch.Tensor] | None = getattr(torch.nn.functional, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)


def grouped_mm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused grouped matmul kernel handles these inputs on their device."""
    if _GROUPED_MM is None or weight.dtype != x.dtype:
        return False
    # The kernels (forward and backward) need rows aligned to 16 bytes.
    aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], weight.shape[-2]))
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16) and aligned
    if x.device.type == "cuda":
        # The CUDA kernel needs bf16 and sm80+.
        return x.dtype == torch.bfloat16 and aligned and _sm80()
    return False


def _sm80() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    The grouped-mm backward rejects expanded (stride-0) gradients, e.g. from ``.sum()``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def grouped_linear(x_NH: torch.Tensor, weight_EOH: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of expert e] = x[rows of expert e] @ weight[e].T`` for rows grouped by expert.

    ``weight_EOH`` is stored like HF fused experts: ``[El, out, in]``. ``counts`` [El] are the
    row counts per expert (they sum to N).
    """
    if grouped_mm_available(x_NH, weight_EOH):
        assert _GROUPED_MM is not None
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        out = _GROUPED_MM(x_NH, weight_EOH.transpose(-2, -1), offs=offsets)
        return _ContiguousGrad.apply(out)  # type: ignore[no-any-return]
    # Fallback: one matmul per expert (empty groups give empty outputs; every weight still
    # joins the graph, so gradients are defined, zero, for experts that got no rows).
    chunks = torch.split(x_NH, counts.tolist())
    outs = [chunk @ weight_EOH[e].transpose(0, 1) for e, chunk in enumerate(chunks)]
    return torch.cat(outs) if outs else x_NH.new_zeros((0, weight_EOH.shape[1]))


def expert_mlp(
    x_NH: torch.Tensor,
    gate_up_EIH: torch.Tensor,
    down_EHI: torch.Tensor,
    counts: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """SwiGLU-style expert MLP (HF fused layout): ``down(act(gate(x)) * up(x))`` per expert.

    ``gate_up_EIH`` is ``[El, 2I, H]`` with the gate rows first, ``down_EHI`` is ``[El, H, I]``.
    """
    gate_up = grouped_linear(x_NH, gate_up_EIH, counts)
    gate, up = gate_up.chunk(2, dim=-1)
    return grouped_linear(act_fn(gate) * up, down_EHI, counts)
