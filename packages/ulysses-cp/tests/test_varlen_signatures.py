"""The CUDA varlen path adapts to both `varlen_attn` signatures (checked on CPU with stand-ins).

torch 2.9's ``varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None)`` has
no ``scale`` / ``window_size`` / ``enable_gqa``; later releases take those keyword-only and have no
``is_causal``. Calling the newer form on the older torch raised ``TypeError`` on the first CUDA bf16
forward; the stand-ins below record what `_varlen_flash` passes and compute the attention that
signature would, so the result must equal the block-diagonal SDPA reference.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.attention.varlen as varlen_mod
import torch.nn.functional as F

from shardforge.ulysses_cp import packed_attention as pa

CU = torch.tensor([0, 5, 12, 16], dtype=torch.int32)


def _qkv(kv_heads: int = 2):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(16, 4, 8, generator=gen),
        torch.randn(16, kv_heads, 8, generator=gen),
        torch.randn(16, kv_heads, 8, generator=gen),
    )


def _attend(q, k, v, cu, scale=None):
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for s, e in itertools.pairwise(bounds):
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True, scale=scale
        )
        out[s:e] = o.transpose(0, 1)
    return out


def _install(monkeypatch, fake):
    monkeypatch.setattr(varlen_mod, "varlen_attn", fake)
    pa._varlen_api.cache_clear()
    return fake


def test_old_signature_gets_is_causal_and_repeated_kv_heads(monkeypatch) -> None:
    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append({"is_causal": is_causal, "kv_heads": key.shape[1]})
        assert key.shape[1] == query.shape[1], "torch 2.9 has no enable_gqa: kv heads must be repeated"
        return _attend(query, key, value, cu_seq_q)

    _install(monkeypatch, varlen_attn)
    try:
        q, k, v = _qkv()
        out = pa._varlen_flash(q, k, v, CU, None, None, None)
        torch.testing.assert_close(out, pa._blockwise_sdpa(q, k, v, CU, None, None))
        assert calls == [{"is_causal": True, "kv_heads": 4}]
        # A non-default scale or a sliding window cannot be expressed: the block-diagonal path runs instead.
        calls.clear()
        out = pa._varlen_flash(q, k, v, CU, 7, 0.5, None)
        torch.testing.assert_close(out, pa._blockwise_sdpa(q, k, v, CU, 0.5, None))
        pa._varlen_flash(q, k, v, CU, 7, None, 3)
        assert calls == []
    finally:
        pa._varlen_api.cache_clear()


def test_new_signature_gets_window_scale_and_gqa(monkeypatch) -> None:
    calls = []

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
    ):  # fmt: skip
        calls.append({"window_size": window_size, "enable_gqa": enable_gqa, "scale": scale})
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return _attend(query, key, value, cu_seq_q, scale)

    _install(monkeypatch, varlen_attn)
    try:
        q, k, v = _qkv()
        out = pa._varlen_flash(q, k, v, CU, None, 0.25, None)
        torch.testing.assert_close(out, pa._blockwise_sdpa(q, k, v, CU, 0.25, None))
        assert calls == [{"window_size": (-1, 0), "enable_gqa": True, "scale": 0.25}]
    finally:
        pa._varlen_api.cache_clear()


def test_this_torch_signature_is_one_of_the_handled_ones() -> None:
    params = pa._varlen_api()
    assert params is not None
    assert "window_size" in params or "is_causal" in params, sorted(params)
