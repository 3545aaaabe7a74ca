"""MoE expert compute on CUDA: the grouped GEMM path (`torch._grouped_mm`, bf16, sm80+) vs HF's
eager ``Qwen3MoeExperts`` loop, forward and backward.

Tolerance: both in bf16 against an fp32 eager reference; the grouped path's error may be at most
3x the bf16 eager loop's relative (Frobenius) error, + 5e-3.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("SHARDFORGE_GPU_TESTS_ON_CPU") == "1"), reason="no CUDA device"
)

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 256, 128, 16, 4, 1024


def _hf_experts(dtype: torch.dtype, device: torch.device):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K)  # fmt: skip
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    return experts.to(device, dtype)


def _inputs(device: torch.device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    values, index = torch.topk(torch.softmax(torch.randn(TOKENS, EXPERTS, generator=gen), -1), TOP_K, dim=-1)
    index[:8] = 0  # expert 0 crowded, some experts possibly empty
    return x.to(device), index.to(device), (values / values.sum(-1, keepdim=True)).to(device)


def _run(experts, x, index, weights, dtype):
    x = x.detach().to(dtype).clone().requires_grad_()
    w = weights.detach().to(dtype).clone().requires_grad_()
    out = experts(x, index, w)
    out.float().square().sum().backward()
    return [t.detach().float() for t in (out, x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad)]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def test_grouped_gemm_matches_hf_eager_experts(device: torch.device) -> None:
    from shardforge.moe_ep import ParallelExperts, grouped_mm_available

    x, index, weights = _inputs(device)
    reference = _run(_hf_experts(torch.float32, device), x, index, weights, torch.float32)
    eager_bf16 = _run(_hf_experts(torch.bfloat16, device), x, index, weights, torch.bfloat16)
    hf = _hf_experts(torch.bfloat16, device)
    ours = ParallelExperts(hf.gate_up_proj, hf.down_proj, hf.act_fn, num_experts=EXPERTS)
    if device.type == "cuda":
        assert grouped_mm_available(x.to(torch.bfloat16), hf.gate_up_proj), "grouped GEMM not taken on CUDA bf16"
    grouped = _run(ours, x, index, weights, torch.bfloat16)
    grouped[3:] = [hf.gate_up_proj.grad.float(), hf.down_proj.grad.float()]  # shared parameters
    for name, r, o, e in zip(("out", "dx", "dweights", "dgate_up", "ddown"), reference, grouped, eager_bf16):
        err, err_eager = _rel(o, r), _rel(e, r)
        assert err <= 3 * err_eager + 5e-3, f"{name}: grouped {err:.3e} vs eager bf16 {err_eager:.3e} (relative)"
