"""Packed attention through the CUDA varlen/flash kernel vs per-sequence SDPA (bf16, fp16; fwd + bwd).

Tolerance: both low-precision paths are compared with an fp32 per-sequence reference; the varlen
kernel's relative (Frobenius) error must stay within 3x that of per-sequence SDPA in the same dtype
(+ 5e-3),
so the test measures the kernel against what the dtype allows rather than a fixed number.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("SHARDFORGE_GPU_TESTS_ON_CPU") == "1"), reason="no CUDA device"
)

LENGTHS = (1, 7, 64, 129, 300, 511)
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _inputs(dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    probe = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return [t.to(device, dtype) for t in (q, k, v, probe)], cu.to(device)


def _per_sequence_sdpa(q, k, v, cu):
    """The reference: one causal SDPA call per sequence (GQA by repeating kv heads)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    outs = []
    bounds = cu.tolist()
    for s, e in itertools.pairwise(bounds):
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _fwd_bwd(fn, q, k, v, probe, cu):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, cu)
    (out.float() * probe.float()).sum().backward()
    return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_kernel_matches_per_sequence_sdpa(dtype: torch.dtype, device: torch.device) -> None:
    from shardforge.ulysses_cp import packed_sdpa
    from shardforge.ulysses_cp.packed_attention import _use_varlen_kernel

    (q, k, v, probe), cu = _inputs(dtype, device)
    if device.type == "cuda":
        assert _use_varlen_kernel(q), "the CUDA varlen kernel is not taken for CUDA bf16/fp16 inputs"
    reference = _fwd_bwd(_per_sequence_sdpa, *(t.float() for t in (q, k, v, probe)), cu)
    ours = _fwd_bwd(lambda q, k, v, cu: packed_sdpa(q, k, v, cu), q, k, v, probe, cu)
    same_dtype_sdpa = _fwd_bwd(_per_sequence_sdpa, q, k, v, probe, cu)
    for name, r, o, s in zip(("out", "dq", "dk", "dv"), reference, ours, same_dtype_sdpa):
        err_ours, err_sdpa = _rel(o, r), _rel(s, r)
        assert err_ours <= 3 * err_sdpa + 5e-3, (
            f"{name}: varlen relative error {err_ours:.3e} vs per-sequence SDPA {err_sdpa:.3e} ({dtype})"
        )


def test_packed_model_forward_matches_padded_sdpa_model(device: torch.device) -> None:
    """A tiny Qwen3 with the packed attention registered: packed batch vs each sequence alone (bf16)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from shardforge.ulysses_cp import packed_model_kwargs, register_packed_attention

    name = register_packed_attention()
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device, torch.bfloat16).eval()
    lengths = [5, 33, 100, 17]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=gen).to(device) for n in lengths]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None]).logits[0].float() for s in seqs])
        model.set_attn_implementation(name)
        ids = torch.cat(seqs)[None]
        pos = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        packed = model(input_ids=ids, position_ids=pos, **packed_model_kwargs(cu)).logits[0].float()
    # bf16 through 2 layers: logits agree to bf16 resolution of their magnitude.
    torch.testing.assert_close(packed, alone, atol=3e-2 * alone.abs().max().item(), rtol=0)
