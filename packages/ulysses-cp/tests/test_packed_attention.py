"""Packed-sequence attention: a packed batch behaves exactly like its sequences run one by one.

Model-level references are the same weights under HF's "eager" attention, one sequence per
forward: the most literal definition of "no attention across sequence boundaries". Kernel
level references are a hand-written per-head softmax(QK^T)V loop in float64.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

import shardforge.ulysses_cp.packed_attention as packed_module
from shardforge.ulysses_cp import (
    PACKED_ATTENTION,
    packed_attention_forward,
    packed_model_kwargs,
    packed_sdpa,
    register_packed_attention,
)

VOCAB = 64
NUM_LAYERS = 2
LENGTHS = [5, 9, 1, 3]

# float32 model-level tolerances. Packed and reference runs do the same math with different
# kernels (SDPA on a block vs eager matmul + softmax) and, for gradients, a different
# summation order (one backward over the packed batch vs gradients accumulated over four
# backwards). Observed: logits within 1e-7 (values ~0.4), gradients within 1e-5 on values up
# to ~40 (a relative 3e-7). Attention leaking across a boundary moves logits by ~0.2.
LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-5}
# float64 kernel-level tolerance: SDPA vs the explicit loop differ only by rounding.
F64_TOL = {"rtol": 1e-10, "atol": 1e-12}


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
    }
    kwargs.update(overrides)
    return cls(**kwargs)


def build_model(arch: str, attn: str, *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A fresh config per model: `from_config(attn_implementation=...)` writes into the config."""
    from transformers import AutoModelForCausalLM

    register_packed_attention()
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation=attn)


def packed_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)])
    return input_ids, position_ids, cu_seqlens


def manual_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: list[int],
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention per sequence and head, written out."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    scale = 1 / math.sqrt(dim) if scale is None else scale
    out = torch.zeros_like(q)
    for start, end in itertools.pairwise(cu):
        n = end - start
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = j <= i
        if window is not None:
            allowed &= (i - j) < window
        for h in range(heads):
            kv = h // (heads // kv_heads)  # GQA: consecutive query heads share one kv head
            scores = (q[start:end, h] @ k[start:end, kv].T) * scale
            probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
            out[start:end, h] = probs @ v[start:end, kv]
    return out


class _CountCalls:
    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- registration
def test_register_is_idempotent_and_custom_names_work() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert register_packed_attention() == PACKED_ATTENTION == "shardforge_packed"
    assert register_packed_attention() == PACKED_ATTENTION
    assert ALL_ATTENTION_FUNCTIONS[PACKED_ATTENTION] is packed_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[PACKED_ATTENTION] is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    assert register_packed_attention("test_packed_alias") == "test_packed_alias"
    model = build_model("qwen3", "test_packed_alias")
    assert model.config._attn_implementation == "test_packed_alias"


def test_packed_model_kwargs() -> None:
    kwargs = packed_model_kwargs(torch.tensor([0, 5, 14, 15, 18]))
    assert set(kwargs) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32 and kwargs["cu_seq_lens_q"].tolist() == [0, 5, 14, 15, 18]
    assert kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 9
    assert packed_model_kwargs(torch.tensor([0, 4]), max_seqlen=16)["max_length_q"] == 16


# ---------------------------------------------------------------------------------------------- model level
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen3", {}),
        ("llama", {}),
        # Every layer sliding with window 3 < most lengths: our window must match HF's exactly.
        ("qwen3", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}),
    ],
    ids=["qwen3", "llama", "qwen3-sliding3"],
)
def test_packed_forward_and_grads_match_separate_runs(
    arch: str, overrides: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model(arch, PACKED_ATTENTION, **overrides)
    reference = build_model(arch, "eager", seed=1, **overrides)
    reference.load_state_dict(model.state_dict())
    input_ids, position_ids, cu_seqlens = packed_batch(LENGTHS)
    bounds = list(itertools.pairwise(cu_seqlens.tolist()))

    spy = _CountCalls(packed_module.packed_sdpa)
    monkeypatch.setattr(packed_module, "packed_sdpa", spy)
    logits = model(input_ids=input_ids, position_ids=position_ids, **packed_model_kwargs(cu_seqlens)).logits
    assert spy.calls == NUM_LAYERS  # the packed path ran, not the SDPA fallback
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    (logits * weights).sum().backward()

    separate = []
    for start, end in bounds:
        out = reference(input_ids=input_ids[:, start:end]).logits
        (out * weights[:, start:end]).sum().backward()  # gradients accumulate over the runs
        separate.append(out.detach())
    torch.testing.assert_close(logits.detach(), torch.cat(separate, dim=1), **LOGITS_TOL)
    ref_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")

    # Sensitivity: the same packed tokens with attention across boundaries are clearly different.
    with torch.no_grad():
        leaky = reference(input_ids=input_ids, position_ids=position_ids).logits
    assert (leaky - logits.detach()).abs().max() > 1e-2


def test_set_attn_implementation_on_existing_model() -> None:
    model = build_model("llama", "sdpa")
    model.set_attn_implementation(PACKED_ATTENTION)
    assert model.config._attn_implementation == PACKED_ATTENTION
    input_ids, position_ids, cu_seqlens = packed_batch([4, 6])
    with torch.no_grad():
        packed = model(input_ids=input_ids, position_ids=position_ids, **packed_model_kwargs(cu_seqlens)).logits
        model.set_attn_implementation("eager")
        separate = torch.cat([model(input_ids=input_ids[:, :4]).logits, model(input_ids=input_ids[:, 4:]).logits], 1)
    torch.testing.assert_close(packed, separate, **LOGITS_TOL)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fallback_without_cu_seqlens_equals_sdpa(arch: str) -> None:
    """No packing kwargs: the same code path as HF's "sdpa" implementation, so equal bit for bit."""
    model = build_model(arch, PACKED_ATTENTION)
    sdpa = build_model(arch, "sdpa", seed=1)
    sdpa.load_state_dict(model.state_dict())
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding exercises the mask function registered with the attention
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": attention_mask}):
            got = model(input_ids=input_ids, **kwargs).logits
            want = sdpa(input_ids=input_ids, **kwargs).logits
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_registered_model_can_generate(arch: str) -> None:
    model = build_model(arch, PACKED_ATTENTION).eval()
    sdpa = build_model(arch, "sdpa", seed=1).eval()
    sdpa.load_state_dict(model.state_dict())
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    out = model.generate(prompt, **kwargs)
    assert out.shape == (2, 11)
    assert torch.equal(out, sdpa.generate(prompt, **kwargs))


# ---------------------------------------------------------------------------------------------- kernel level
def _qkv(total: int, heads: int, kv_heads: int, dim: int = 8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(total, h, dim, dtype=torch.float64, generator=gen).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    ]


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (4, 1)], ids=["gqa3", "mha", "mqa"])
@pytest.mark.parametrize("scale", [None, 0.3], ids=["default-scale", "scale0.3"])
def test_packed_sdpa_matches_manual_reference(heads: int, kv_heads: int, scale: float | None) -> None:
    lengths = [3, 0, 7, 1, 7, 3]  # an empty sequence, and repeated lengths (batched together)
    cu = [0, *itertools.accumulate(lengths)]
    q, k, v = _qkv(cu[-1], heads, kv_heads)
    got = packed_sdpa(q, k, v, torch.tensor(cu), scale=scale)
    want = manual_attention(q, k, v, cu, scale=scale)
    torch.testing.assert_close(got, want, **F64_TOL)
    # Gradients flow through the packing (gather/scatter) as through the loop.
    upstream = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got_grads = torch.autograd.grad(got, (q, k, v), upstream)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, **F64_TOL)


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)], ids=["gqa3", "mha"])
def test_shared_prefixes_equal_the_unshared_attention(heads: int, kv_heads: int) -> None:
    """Sequences 1, 2 (and 4) repeat the first 5 (4) tokens of sequence 0 (3): dropping those (but the last
    shared one) and pointing ``prefixes`` at the source gives every kept token its unshared output, and the
    source's prefix tokens collect the dropped copies' gradients."""
    lengths, shared = [7, 9, 6, 6, 5], [0, 5, 5, 0, 4]
    sources = [0, 0, 0, 3, 3]
    cu = [0, *itertools.accumulate(lengths)]
    q0, k0, v0 = (t.detach() for t in _qkv(cu[-1], heads, kv_heads, seed=3))
    for i, p in enumerate(shared):  # make the shared tokens equal to the source's
        for t in (q0, k0, v0):
            t[cu[i] : cu[i] + p] = t[cu[sources[i]] : cu[sources[i]] + p]
    keep = torch.cat([torch.arange(cu[i] + max(p - 1, 0), cu[i + 1]) for i, p in enumerate(shared)])
    kept_lengths = [n - max(p - 1, 0) for n, p in zip(lengths, shared, strict=True)]
    kept_cu = [0, *itertools.accumulate(kept_lengths)]
    prefixes = torch.tensor([[kept_cu[sources[i]], p - 1] if p else [0, 0] for i, p in enumerate(shared)])
    q, k, v = (t[keep].clone().requires_grad_() for t in (q0, k0, v0))
    got = packed_sdpa(q, k, v, torch.tensor(kept_cu), prefixes=prefixes)
    want_full = manual_attention(q0, k0, v0, cu)
    torch.testing.assert_close(got, want_full[keep], **F64_TOL)
    # gradients: the unshared attention's, with each dropped token's gradient added to its source copy
    qf, kf, vf = (t.clone().requires_grad_() for t in (q0, k0, v0))
    upstream = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    full_up = torch.zeros(want_full.shape, dtype=torch.float64)
    full_up[keep] = upstream
    want_grads = torch.autograd.grad(manual_attention(qf, kf, vf, cu), (kf, vf), full_up)
    got_grads = torch.autograd.grad(got, (k, v), upstream)
    for got_g, full_g in zip(got_grads, want_grads, strict=True):
        folded = full_g.clone()
        for i, p in enumerate(shared):
            if p > 1:  # the dropped tokens' key/value gradients belong to the source's tokens
                src = cu[sources[i]]
                folded[src : src + p - 1] += folded[cu[i] : cu[i] + p - 1]
        torch.testing.assert_close(got_g, folded[keep], **F64_TOL)
    with pytest.raises(ValueError, match="must lie in the batch before the sequence"):
        packed_sdpa(q, k, v, torch.tensor(kept_cu), prefixes=torch.tensor([[0, 0], [0, 50], [0, 0], [0, 0], [0, 0]]))
    with pytest.raises(ValueError, match="sliding-window"):
        packed_sdpa(q, k, v, torch.tensor(kept_cu), prefixes=prefixes, sliding_window=2)


@pytest.mark.parametrize("window", [1, 3, 4, 100])
def test_sliding_window_matches_manual_reference(window: int) -> None:
    lengths = [2, 6, 3, 9, 4]  # shorter than, equal to and longer than the windows
    cu = [0, *itertools.accumulate(lengths)]
    q, k, v = _qkv(cu[-1], 4, 2, seed=2)
    got = packed_sdpa(q, k, v, torch.tensor(cu), sliding_window=window)
    torch.testing.assert_close(got, manual_attention(q, k, v, cu, window=window), **F64_TOL)
    if window < max(lengths):
        assert not torch.allclose(got, manual_attention(q, k, v, cu))  # the window did something


def test_packed_attention_forward_layout() -> None:
    """HF layout in ([1, H, T, D] / [1, Hkv, T, D]), [1, T, H, D] out, no attention weights."""
    cu = [0, 4, 9]
    q, k, v = (t.detach() for t in _qkv(9, 4, 2))
    out, weights = packed_attention_forward(
        torch.nn.Module(),
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        None,
        scaling=0.5,
        **packed_model_kwargs(torch.tensor(cu)),
    )
    assert weights is None and out.shape == (1, 9, 4, 8)
    torch.testing.assert_close(out[0], manual_attention(q, k, v, cu, scale=0.5), **F64_TOL)


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("heads", "kv_heads", "cu", "match"),
    [
        (4, 2, [0, 4, 8], r"cu_seqlens\[-1\]=8 must equal the packed length T=9"),
        (4, 2, [0, 4, 10], r"cu_seqlens\[-1\]=10 must equal the packed length T=9"),
        (6, 4, [0, 4, 9], r"query heads \(6\) must be a multiple of key/value heads \(4\)"),
        (4, 2, [2, 4, 9], "must start at 0 and be non-decreasing"),
        (4, 2, [0, 6, 4, 9], "must start at 0 and be non-decreasing"),
    ],
    ids=["short", "long", "heads", "not-from-0", "decreasing"],
)
def test_packed_sdpa_errors(heads: int, kv_heads: int, cu: list[int], match: str) -> None:
    q, k, v = _qkv(9, heads, kv_heads)
    with pytest.raises(ValueError, match=match):
        packed_sdpa(q, k, v, torch.tensor(cu))


def test_packed_attention_forward_errors() -> None:
    kwargs = packed_model_kwargs(torch.tensor([0, 3, 6]))
    q, k, v = (torch.randn(2, h, 6, 8) for h in (4, 2, 2))  # batch size 2
    with pytest.raises(ValueError, match="expects batch size 1"):
        packed_attention_forward(torch.nn.Module(), q, k, v, None, **kwargs)
    with pytest.raises(ValueError, match="attention dropout"):
        packed_attention_forward(torch.nn.Module(), q[:1], k[:1], v[:1], None, dropout=0.1, **kwargs)


def test_model_with_batch_of_two_and_packing_raises() -> None:
    model = build_model("qwen3", PACKED_ATTENTION)
    input_ids = torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(ValueError, match="expects batch size 1"):
        model(input_ids=input_ids, **packed_model_kwargs(torch.tensor([0, 3, 6])))
