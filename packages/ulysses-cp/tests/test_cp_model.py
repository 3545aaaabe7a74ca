"""Ulysses context parallelism (cp 2 and 4) equals the single-process packed run (cp 1).

On 4 local gloo ranks, laid out as the engine does: 'd2c2' (two CP groups of 2, each with its
own packed batch) and 'c4'. Each CP rank feeds its contiguous slice of the padded packed
batch with the global ``cu_seqlens``; per-token outputs are gathered with
`gather_sequence`. References are the unpadded batch in one process, so padding leaking
into real tokens would show.

Everything runs in float64 so the tolerances can be tight: CP changes only summation
order (per-rank partial weight gradients summed by all_reduce, attention on a subset of
heads per call), which moves float64 results by ~1e-15 relative. A wrong head/kv mapping or a
sequence-boundary error moves logits by ~1e-1.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardforge.ulysses_cp.packed_attention as packed_module
from shardforge.mesh import ParallelDims, build_mesh
from shardforge.mesh.testing import get_rank_pool
from shardforge.ulysses_cp import (
    CP_GROUP_KWARG,
    gather_sequence,
    packed_attention_forward,
    packed_model_kwargs,
    packed_sdpa,
    register_packed_attention,
    slice_for_rank,
)

WORLD = 4
VOCAB = 64
NUM_LAYERS = 2
HEADS = 4
# One packed batch per CP group. Sums 17 and 13: not multiples of 2 or 4, so a padding
# sequence is appended; CP chunk borders fall inside sequences (e.g. token 9 of 18 at cp 2).
BATCHES = ([6, 9, 1, 1], [4, 7, 2])
# float64 tolerances (see the module docstring); observed differences are ~1e-15.
TOL: dict[str, Any] = {"rtol": 1e-9, "atol": 1e-11}


def tiny_config(arch: str, kv_heads: int, **overrides: Any) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": kv_heads,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "use_cache": False,
    }
    kwargs.update(overrides)
    return cls(**kwargs)


def build_model(config: Any, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_packed_attention())
    if state is not None:
        model.load_state_dict(state)
    return model.to(torch.float64)


def make_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """A packed batch with per-token loss weights: 0 on each sequence's last token (its next
    token belongs to another sequence), random positive elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    weights = torch.rand(sum(lengths), dtype=torch.float64, generator=gen) + 0.5
    weights[cu[1:].long() - 1] = 0.0
    return {
        "input_ids": torch.randint(0, VOCAB, (sum(lengths),), generator=gen),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]),
        "cu_seqlens": cu,
        "weights": weights,
    }


def pad_batch(batch: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """As the engine's `pad_to_multiple`: one extra padding sequence (token 0, weight 0)."""
    pad = -len(batch["input_ids"]) % multiple
    if pad == 0:
        return batch
    return {
        "input_ids": torch.cat([batch["input_ids"], batch["input_ids"].new_zeros(pad)]),
        "position_ids": torch.cat([batch["position_ids"], torch.arange(pad)]),
        "cu_seqlens": torch.cat([batch["cu_seqlens"], batch["cu_seqlens"][-1:] + pad]),
        "weights": torch.cat([batch["weights"], batch["weights"].new_zeros(pad)]),
    }


def cp_layout(cp: int) -> tuple[dist.ProcessGroup, int, int]:
    """(cp group, rank in it, data-parallel index) for the engine's layout 'd{4/cp}c{cp}'."""
    dp = dist.get_world_size() // cp
    mesh = build_mesh(ParallelDims(dp_shard=dp, cp=cp), device_type="cpu")
    group = mesh.get("cp").get_group()
    assert dist.get_world_size(group) == cp and dist.get_rank(group) == mesh.local_rank("cp")
    return group, mesh.local_rank("cp"), mesh.local_rank("dp_shard")


def _prefixed(prefix: str) -> Callable[[str], str]:
    """An `assert_close` message callback that names the tensor."""
    return lambda message: f"{prefix}: {message}"


class _SpySeqToHead:
    """Records the head count of every tensor the Ulysses path sends through `seq_to_head`."""

    def __init__(self) -> None:
        self.fn = packed_module.seq_to_head
        self.heads: list[int] = []

    def __call__(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        self.heads.append(x.shape[1])
        return self.fn(x, group)  # type: ignore[no-any-return]

    def __enter__(self) -> _SpySeqToHead:
        packed_module.seq_to_head = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        packed_module.seq_to_head = self.fn


# ---------------------------------------------------------------------------------------------- attention layer
def _attention_rank(cp: int, data: list[dict[str, torch.Tensor]], window: int | None) -> dict[str, Any]:
    group, r, index = cp_layout(cp)
    d = data[index]
    q, k, v = (slice_for_rank(d[name], r, cp).detach().requires_grad_() for name in ("q", "k", "v"))
    kwargs = packed_model_kwargs(d["cu_seqlens"], cp_group=group)
    with _SpySeqToHead() as spy:
        # HF layout: [1, heads, tokens, dim] in, [1, tokens, heads, dim] out.
        out, weights = packed_attention_forward(
            nn.Module(),
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            None,
            scaling=0.3,
            sliding_window=window,
            **kwargs,
        )
    assert weights is None
    (out[0] * slice_for_rank(d["w"], r, cp)).sum().backward()
    return {"index": index, "rank": r, "out": out[0].detach(), "grads": [x.grad for x in (q, k, v)], "spy": spy.heads}


@pytest.mark.parametrize(
    ("cp", "heads", "kv_heads", "window"),
    [
        (2, 4, 4, None),
        (2, 4, 2, None),
        (2, 4, 1, None),  # kv repeated to cp
        (4, 4, 4, None),
        (4, 4, 2, None),  # kv repeated to cp
        (4, 4, 1, None),
        (4, 8, 2, None),  # 2 query heads per rank share one repeated kv head
        (2, 6, 2, 3),  # sliding window
        (4, 8, 2, 4),
    ],
)
def test_attention_layer_matches_packed_sdpa(cp: int, heads: int, kv_heads: int, window: int | None) -> None:
    data, refs = [], []
    for seed, lengths in enumerate(BATCHES[: WORLD // cp]):
        lengths = [*lengths, -sum(lengths) % cp]  # padding sequence (possibly empty)
        gen = torch.Generator().manual_seed(seed)
        total = sum(lengths)
        d = {
            "q": torch.randn(total, heads, 8, dtype=torch.float64, generator=gen),
            "k": torch.randn(total, kv_heads, 8, dtype=torch.float64, generator=gen),
            "v": torch.randn(total, kv_heads, 8, dtype=torch.float64, generator=gen),
            "w": torch.randn(total, heads, 8, dtype=torch.float64, generator=gen),
            "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)]),
        }
        q, k, v = (d[name].clone().requires_grad_() for name in ("q", "k", "v"))
        out = packed_sdpa(q, k, v, d["cu_seqlens"], scale=0.3, sliding_window=window)
        (out * d["w"]).sum().backward()
        data.append(d)
        refs.append((out.detach(), q.grad, k.grad, v.grad))

    kv_sent = kv_heads if kv_heads % cp == 0 else cp  # fewer kv heads than cp: repeated up to cp
    for res in get_rank_pool(WORLD).run(_attention_rank, cp, data, window):
        ref_out, *ref_grads = refs[res["index"]]
        r = res["rank"]
        assert res["spy"] == [heads, kv_sent, kv_sent]  # the Ulysses path ran, with the expected kv layout
        torch.testing.assert_close(res["out"], slice_for_rank(ref_out, r, cp), **TOL)
        for name, got, want in zip("qkv", res["grads"], ref_grads, strict=True):
            # Each rank's leaf is its own token slice: its gradient is that slice of the full one
            # (for kv heads repeated to cp, the copies' gradients are summed by repeat's backward).
            torch.testing.assert_close(got, slice_for_rank(want, r, cp), **TOL, msg=_prefixed(f"d{name}"))


# ---------------------------------------------------------------------------------------------- whole models
def _next_token_logprobs(
    model: nn.Module, batch: dict[str, torch.Tensor], targets: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=batch["input_ids"][None], position_ids=batch["position_ids"][None], **kwargs).logits[0]
    return logits, -F.cross_entropy(logits, targets, reduction="none")


def _model_rank(
    config: Any, state: dict[str, torch.Tensor], batches: list[dict[str, torch.Tensor]], cp: int
) -> dict[str, Any]:
    group, r, index = cp_layout(cp)
    model = build_model(config, state)
    padded = pad_batch(batches[index], cp)
    # Next-token targets from the whole sequence before slicing: a chunk's last token still
    # knows its target (as in the engine).
    targets = torch.roll(padded["input_ids"], -1)
    local = {name: slice_for_rank(padded[name], r, cp) for name in ("input_ids", "position_ids")}
    with _SpySeqToHead() as spy:
        logits, next_logprobs = _next_token_logprobs(
            model,
            local,
            slice_for_rank(targets, r, cp),
            **packed_model_kwargs(padded["cu_seqlens"], cp_group=group),
        )
    logprobs = gather_sequence(next_logprobs, group)
    loss = -(logprobs * padded["weights"]).sum()  # same loss on every CP rank; padding has weight 0
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        # Each CP rank's gradient covers its own tokens only: the full gradient is the sum.
        dist.all_reduce(param.grad, group=group)
        grads[name] = param.grad
    return {
        "index": index,
        "logits": gather_sequence(logits.detach(), group),
        "logprobs": logprobs.detach(),
        "loss": loss.detach(),
        "grads": grads,
        "spy": spy.heads,
    }


MODEL_CASES = [
    pytest.param(arch, kv, cp, {}, id=f"{arch}-kv{kv}-cp{cp}")
    for arch in ("qwen3", "llama")
    for cp in (2, 4)
    for kv in (4, 2, 1)
]
MODEL_CASES.append(
    pytest.param(
        "qwen3",
        2,
        4,
        {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0},
        id="qwen3-kv2-cp4-sliding3",
    )
)


@pytest.mark.parametrize(("arch", "kv_heads", "cp", "overrides"), MODEL_CASES)
def test_model_logprobs_and_grads_match_cp1(arch: str, kv_heads: int, cp: int, overrides: dict[str, Any]) -> None:
    config = tiny_config(arch, kv_heads, **overrides)
    reference = build_model(config)
    state = reference.state_dict()
    batches = [make_batch(lengths, seed) for seed, lengths in enumerate(BATCHES[: WORLD // cp])]

    refs = []
    for batch in batches:
        reference.zero_grad()
        num_tokens = len(batch["input_ids"])
        # Targets of the padded batch: the last real token's "next token" is the padding token
        # (weight 0 either way), so log-probs agree on every real position.
        targets = torch.roll(pad_batch(batch, cp)["input_ids"], -1)[:num_tokens]
        logits, logprobs = _next_token_logprobs(reference, batch, targets, **packed_model_kwargs(batch["cu_seqlens"]))
        loss = -(logprobs * batch["weights"]).sum()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in reference.named_parameters() if p.grad is not None}
        refs.append((logits.detach(), logprobs.detach(), loss.detach(), grads))

    kv_sent = kv_heads if kv_heads % cp == 0 else cp
    results = get_rank_pool(WORLD).run(_model_rank, config, state, batches, cp)
    assert sorted(res["index"] for res in results) == sorted(list(range(WORLD // cp)) * cp)
    for res in results:
        ref_logits, ref_logprobs, ref_loss, ref_grads = refs[res["index"]]
        num_tokens = ref_logits.shape[0]
        assert res["spy"] == [HEADS, kv_sent, kv_sent] * NUM_LAYERS  # Ulysses ran in every layer
        assert res["logits"].shape[0] == num_tokens + (-num_tokens % cp)
        torch.testing.assert_close(res["logits"][:num_tokens], ref_logits, **TOL)
        torch.testing.assert_close(res["logprobs"][:num_tokens], ref_logprobs, **TOL)
        torch.testing.assert_close(res["loss"], ref_loss, **TOL)
        assert set(res["grads"]) == set(ref_grads) == {n for n, _ in reference.named_parameters()}
        for name, grad in res["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=_prefixed(name))


# ---------------------------------------------------------------------------------------------- fallback
def test_no_cp_group_is_the_plain_packed_path() -> None:
    """cp_group=None adds no kwarg, and an explicit None group runs plain packed attention."""
    assert not dist.is_initialized()
    cu = torch.tensor([0, 3, 8])
    assert packed_model_kwargs(cu, cp_group=None).keys() == packed_model_kwargs(cu).keys()
    assert CP_GROUP_KWARG not in packed_model_kwargs(cu, cp_group=None)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 4, generator=gen) for h in (4, 2, 2))
    with _SpySeqToHead() as spy:
        kwargs: dict[str, Any] = {**packed_model_kwargs(cu), CP_GROUP_KWARG: None}
        out, _ = packed_attention_forward(nn.Module(), q, k, v, None, **kwargs)
    assert spy.heads == []
    want = packed_sdpa(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu)
    assert torch.equal(out[0], want)


def _single_group_rank() -> dict[str, Any]:
    singles = [dist.new_group([i]) for i in range(dist.get_world_size())]
    mine = singles[dist.get_rank()]
    cu = torch.tensor([0, 3, 8])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 4, generator=gen) for h in (4, 2, 2))
    with _SpySeqToHead() as spy:
        # A CP group of size 1 is no CP: no collective, the whole sequence on this rank.
        kwargs: dict[str, Any] = {**packed_model_kwargs(cu), CP_GROUP_KWARG: mine}
        out, _ = packed_attention_forward(nn.Module(), q, k, v, None, **kwargs)
    want = packed_sdpa(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu)
    return {
        "omitted": CP_GROUP_KWARG not in packed_model_kwargs(cu, cp_group=mine),
        "spy": spy.heads,
        "equal": torch.equal(out[0], want),
    }


def test_size_one_cp_group_is_the_plain_packed_path() -> None:
    for res in get_rank_pool(WORLD).run(_single_group_rank):
        assert res == {"omitted": True, "spy": [], "equal": True}
