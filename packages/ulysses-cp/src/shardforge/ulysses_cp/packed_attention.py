"""Packed-sequence (cu_seqlens) attention for HF models, registered via `AttentionInterface`.

Legend: T = packed tokens of all sequences, H = query heads, Hkv = key/value heads,
D = head dim, N = number of sequences. ``cu_seqlens`` [N+1] holds sequence boundaries.

HF passes the packing through the model's ``**kwargs`` as ``cu_seq_lens_q`` /
``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` (the flash-attention kwargs), so
no module is patched: a model opts in with ``config._attn_implementation = "shardforge_packed"``
(see `register_packed_attention`). Without cu_seqlens (e.g. during ``generate``) the
function falls back to HF's SDPA path, so one model serves training and generation.

Back-ends: on CUDA with fp16/bf16, `torch.nn.attention.varlen.varlen_attn` (flash varlen; both its
torch 2.9 signature and the later keyword one are handled);
elsewhere, causal SDPA per sequence (block-diagonal; equal-length sequences share one call),
which computes sum(L_i^2) scores instead of T^2 and never builds a [T, T] mask.

Shared prefixes (``prefixes``, [N, 2]: for sequence i, a token start s_i and a length P_i): sequence i's
queries also attend to the keys of tokens [s_i, s_i + P_i) of the packed batch, placed before its own.
A batch of group samples (e.g. GRPO's n completions of one prompt) can then hold the prompt once: the
other samples keep only the prompt's last token (positions continue after the prefix) and point at the
first sample's prompt. Only the per-sequence SDPA path implements it (the CUDA varlen path falls back).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardforge.ulysses_cp.all_to_all import head_to_seq, seq_to_head

__all__ = [
    "CP_GROUP_KWARG",
    "PACKED_ATTENTION",
    "PREFIX_KWARG",
    "packed_attention_forward",
    "packed_model_kwargs",
    "packed_sdpa",
    "register_packed_attention",
]

PACKED_ATTENTION = "shardforge_packed"


def register_packed_attention(name: str = PACKED_ATTENTION) -> str:
    """Register the packed attention (and its mask function) under ``name``; return the name.

    Idempotent. Use it with ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)``
    or ``model.set_attn_implementation(name)``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, packed_attention_forward)
    # Packed calls need no mask; the fallback (no cu_seqlens) uses SDPA, so use SDPA's mask.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


CP_GROUP_KWARG = "shardforge_cp_group"
"""Forward kwarg carrying the context-parallel process group (None or size 1 = no CP)."""


PREFIX_KWARG = "shardforge_prefixes"
"""Forward kwarg carrying shared prefixes ([N, 2] token start and length per sequence; see the module)."""


def packed_model_kwargs(
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    cp_group: dist.ProcessGroup | None = None,
    prefixes: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The extra forward kwargs that route a packed batch to `packed_attention_forward`.

    With ``cp_group`` (Ulysses context parallelism) ``cu_seqlens`` describes the *global*
    packed sequence while each rank feeds its contiguous 1/cp slice of the tokens. ``prefixes``
    ([N, 2]) gives sequences shared prefixes (see the module); not with context parallelism.
    """
    cu = cu_seqlens.to(torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    kwargs: dict[str, Any] = {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        if prefixes is not None:
            raise ValueError("shared prefixes are not supported with context parallelism (cp > 1)")
        kwargs[CP_GROUP_KWARG] = cp_group
    if prefixes is not None:
        kwargs[PREFIX_KWARG] = prefixes
    return kwargs


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function. query [1, H, T, D]; key/value [1, Hkv, T, D] -> [1, T, H, D]."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"packed attention expects batch size 1 (all sequences concatenated), got query shape {tuple(query.shape)}"
        )
    if dropout:
        raise ValueError("packed attention does not implement attention dropout; set attention_dropout=0.0")
    max_seqlen = kwargs.get("max_length_q")
    cp_group = kwargs.get(CP_GROUP_KWARG)
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        return _ulysses_attention(query, key, value, cu_seqlens, cp_group, max_seqlen, scaling, sliding_window)
    out_THD = packed_sdpa(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_seqlens,
        max_seqlen=max_seqlen,
        scale=scaling,
        sliding_window=sliding_window,
        prefixes=kwargs.get(PREFIX_KWARG),
    )
    return out_THD.unsqueeze(0), None


def _ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup,
    max_seqlen: int | None,
    scale: float | None,
    sliding_window: int | None,
) -> tuple[torch.Tensor, None]:
    """Sequence-sharded q/k/v -> all-to-all to head shards -> packed attention -> back."""
    cp = dist.get_world_size(group)
    q_SHD, k_SHD, v_SHD = (x[0].transpose(0, 1) for x in (query, key, value))
    kv_heads = k_SHD.shape[1]
    if kv_heads % cp != 0:
        if cp % kv_heads != 0:
            raise ValueError(f"key/value heads on this rank ({kv_heads}) must divide or be divisible by cp={cp}")
        # Fewer kv heads than CP ranks: give every rank one copy of the kv head its query
        # heads read (query head block r maps to kv head r // (cp / kv_heads)).
        k_SHD = k_SHD.repeat_interleave(cp // kv_heads, dim=1)
        v_SHD = v_SHD.repeat_interleave(cp // kv_heads, dim=1)
    out_THD = packed_sdpa(
        seq_to_head(q_SHD, group),
        seq_to_head(k_SHD, group),
        seq_to_head(v_SHD, group),
        cu_seqlens,
        max_seqlen=max_seqlen,
        scale=scale,
        sliding_window=sliding_window,
    )
    return head_to_seq(out_THD, group).unsqueeze(0), None


def packed_sdpa(
    q_THD: torch.Tensor,
    k_THD: torch.Tensor,
    v_THD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: int | None = None,
    scale: float | None = None,
    sliding_window: int | None = None,
    prefixes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence. q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].

    ``prefixes`` [N, 2] (token start, length; length 0 = none): keys each sequence attends to before
    its own (see the module)."""
    num_heads, num_kv_heads = q_THD.shape[1], k_THD.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv_heads})")
    bounds = cu_seqlens.tolist()  # one host sync, as for cu_seqlens[-1] alone
    if bounds[-1] != q_THD.shape[0]:
        raise ValueError(f"cu_seqlens[-1]={bounds[-1]} must equal the packed length T={q_THD.shape[0]}")
    if bounds[0] != 0 or any(end < start for start, end in itertools.pairwise(bounds)):
        # Positions outside [cu[0], cu[-1]) or inside a negative-length span would never be written.
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {bounds}")
    spans = _prefix_spans(prefixes, bounds) if prefixes is not None else None
    if spans is not None and any(length for _, length in spans):
        if sliding_window is not None:
            raise ValueError("shared prefixes are not supported with sliding-window attention")
        return _blockwise_sdpa(q_THD, k_THD, v_THD, cu_seqlens, scale, None, spans)
    if _use_varlen_kernel(q_THD):
        return _varlen_flash(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, scale, sliding_window)
    return _blockwise_sdpa(q_THD, k_THD, v_THD, cu_seqlens, scale, sliding_window)


def _prefix_spans(prefixes: torch.Tensor, bounds: list[int]) -> list[tuple[int, int]]:
    """``prefixes`` as (start, length) pairs, checked: one per sequence, inside the batch, before the sequence."""
    spans = [(int(a), int(b)) for a, b in prefixes.tolist()]
    if len(spans) != len(bounds) - 1:
        raise ValueError(f"prefixes has {len(spans)} rows for {len(bounds) - 1} sequences (one [start, length] each)")
    for i, (start, length) in enumerate(spans):
        if length and not (0 <= start and length > 0 and start + length <= bounds[i]):
            raise ValueError(
                f"sequence {i} (tokens {bounds[i]}..{bounds[i + 1]}) has prefix tokens {start}..{start + length}: "
                "a prefix must lie in the batch before the sequence it serves"
            )
    return spans


def _use_varlen_kernel(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _varlen_api() is not None


@functools.cache
def _varlen_api() -> frozenset[str] | None:
    """The parameter names of this torch's ``varlen_attn`` (None: no such function).

    The signature changed between releases: torch 2.9 has ``is_causal`` and no ``scale``,
    ``window_size`` or ``enable_gqa``; later releases take keyword-only ``scale``, ``window_size``
    and ``enable_gqa`` and no ``is_causal``. `_varlen_flash` adapts to either.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    scale: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_api() or frozenset()
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (sliding_window - 1, 0) if sliding_window else (-1, 0)
    elif "is_causal" in params and not sliding_window:
        kwargs["is_causal"] = True
    else:  # no way to ask this torch for a sliding (or causal) window: block-diagonal SDPA
        return _blockwise_sdpa(q, k, v, cu_seqlens, scale, sliding_window)
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        elif not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
            return _blockwise_sdpa(q, k, v, cu_seqlens, scale, sliding_window)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max().item())
    out = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)
    assert isinstance(out, torch.Tensor)
    return out


def _blockwise_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    sliding_window: int | None,
    prefixes: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    bounds = cu_seqlens.tolist()
    by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            prefix_start, prefix_len = prefixes[i] if prefixes is not None else (0, 0)
            by_shape.setdefault((end - start, prefix_len), []).append((start, prefix_start))
    outs: list[torch.Tensor] = []
    flats: list[torch.Tensor] = []
    # Sequences of equal length (and shared-prefix length) run as one batched SDPA call: packed
    # batches of short sequences would otherwise pay per-call overhead once per sequence and layer.
    for (length, prefix_len), items in by_shape.items():
        starts = torch.tensor([start for start, _ in items], device=q.device)
        index_NL = starts[:, None] + torch.arange(length, device=q.device)
        flat = index_NL.reshape(-1)
        q_NHLD = q[flat].view(len(items), length, *q.shape[1:]).transpose(1, 2)
        keys = flat
        if prefix_len:  # each sequence's keys: its prefix's tokens, then its own
            prefix_starts = torch.tensor([p for _, p in items], device=q.device)
            prefix_NP = prefix_starts[:, None] + torch.arange(prefix_len, device=q.device)
            keys = torch.cat([prefix_NP, index_NL], dim=1).reshape(-1)
        k_NHLD = k[keys].view(len(items), prefix_len + length, *k.shape[1:]).transpose(1, 2)
        v_NHLD = v[keys].view(len(items), prefix_len + length, *v.shape[1:]).transpose(1, 2)
        mask = None
        if prefix_len:  # the whole prefix, then causal over the sequence's own keys
            rows, cols = torch.arange(length, device=q.device), torch.arange(prefix_len + length, device=q.device)
            mask = cols[None, :] <= rows[:, None] + prefix_len
        elif sliding_window is not None and length > sliding_window:
            idx = torch.arange(length, device=q.device)
            diff = idx[:, None] - idx[None, :]
            mask = (diff >= 0) & (diff < sliding_window)
        o_NHLD = F.scaled_dot_product_attention(
            q_NHLD, k_NHLD, v_NHLD, attn_mask=mask, is_causal=mask is None, scale=scale
        )
        outs.append(o_NHLD.transpose(1, 2).reshape(-1, *q.shape[1:]))
        flats.append(flat)
    if not outs:
        return q.new_zeros(q.shape)
    flat = torch.cat(flats)
    if flat.numel() == q.shape[0]:
        # Every token belongs to a sequence: one gather puts the groups back in token order (an
        # index_copy per length group would copy, and in backward zero-fill, the whole output per group).
        return torch.cat(outs)[torch.argsort(flat)]
    return q.new_zeros(q.shape).index_copy(0, flat, torch.cat(outs))
