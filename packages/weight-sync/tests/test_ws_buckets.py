"""`iter_buckets` / `canonical_parameters`: bucket sizes, canonical names, dtype cast, and
bit-exact gathering of FSDP 2 and 2-D (FSDP x TP) DTensors on local gloo ranks.

Rank functions are module-level so the shared rank pools can pickle them.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from shardforge.mesh.testing import get_rank_pool
from shardforge.weight_sync import Bucket, canonical_parameters, iter_buckets


class TinyNet(nn.Module):
    """Tied embedding/head, odd shapes, float + int persistent buffers, a non-persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 6)) for _ in range(2))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two names
        self.register_buffer("running", torch.linspace(-1.0, 1.0, 5))
        self.register_buffer("step", torch.tensor([7, 9], dtype=torch.int64))
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


EXPECTED_NAMES = [
    "embed.weight",
    "blocks.0.0.weight",
    "blocks.0.0.bias",
    "blocks.0.2.weight",
    "blocks.0.2.bias",
    "blocks.1.0.weight",
    "blocks.1.0.bias",
    "blocks.1.2.weight",
    "blocks.1.2.bias",
    "norm.weight",
    "norm.bias",
    "running",
    "step",
]


def _tiny() -> TinyNet:
    torch.manual_seed(0)
    model = TinyNet()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # no exact zeros/ones, so a wrong copy is visible
    return model


def _size(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return t.numel() * torch.empty((), dtype=target).element_size()


def check_buckets(
    buckets: list[Bucket], reference: dict[str, torch.Tensor], order: list[str], bucket_bytes: int, dtype: Any
) -> None:
    """Sizes, contiguous indices, canonical order, greedy packing and bit-exact contents."""
    assert [b.index for b in buckets] == list(range(len(buckets)))
    names = [n for b in buckets for n in b.names]
    assert names == order, "every tensor exactly once, in canonical order"
    for i, bucket in enumerate(buckets):
        assert len(bucket.names) == len(bucket.tensors) >= 1
        assert bucket.nbytes == sum(_size(reference[n], dtype) for n in bucket.names)
        if len(bucket.names) > 1:  # only a tensor alone in its bucket may exceed the limit
            assert bucket.nbytes <= bucket_bytes, (i, bucket.names, bucket.nbytes)
        if i + 1 < len(buckets):  # greedy: the bucket closed because the next tensor did not fit
            first_next = buckets[i + 1].names[0]
            assert bucket.nbytes + _size(reference[first_next], dtype) > bucket_bytes
        for name, tensor in zip(bucket.names, bucket.tensors):
            ref = reference[name]
            expected = ref.to(dtype) if dtype is not None and ref.is_floating_point() else ref
            assert tensor.dtype == expected.dtype, name
            assert tensor.device.type == "cpu"
            assert torch.equal(tensor, expected), name


def test_canonical_parameters_names_ties_and_buffers() -> None:
    model = _tiny()
    entries = canonical_parameters(model)
    assert [n for n, _ in entries] == EXPECTED_NAMES
    assert "head.weight" not in dict(entries), "tied alias listed once, under its first name"
    assert "inv_freq" not in dict(entries), "non-persistent buffers are not part of a version"
    # every canonical name is loadable by name into the module's state dict
    assert set(EXPECTED_NAMES) <= set(model.state_dict())


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bucket_bytes", [1, 40, 100, 196, 300, 10**9])  # 196: a 7x6 weight + bias exactly
def test_bucket_sizes_order_and_cast(bucket_bytes: int, dtype: Any) -> None:
    model = _tiny()
    reference = {n: t.detach().clone() for n, t in canonical_parameters(model)}
    buckets = list(iter_buckets(model, bucket_bytes, dtype=dtype))
    assert all(isinstance(b, Bucket) for b in buckets)
    check_buckets(buckets, reference, EXPECTED_NAMES, bucket_bytes, dtype)  # type: ignore[arg-type]
    step = next(t for b in buckets for n, t in zip(b.names, b.tensors) if n == "step")
    assert step.dtype == torch.int64 and step.tolist() == [7, 9], "integer buffers are never cast"
    if bucket_bytes == 1:
        assert len(buckets) == len(EXPECTED_NAMES), "each tensor alone when none fits"
    if bucket_bytes == 10**9:
        assert len(buckets) == 1
    if bucket_bytes == 196 and dtype is None:  # a bucket filled exactly to the limit
        assert ["blocks.0.0.weight", "blocks.0.0.bias"] in [b.names for b in buckets]


def test_oversized_tensor_gets_its_own_bucket() -> None:
    model = _tiny()
    big = model.embed.weight.numel() * 4  # 264 bytes, larger than the limit below
    buckets = list(iter_buckets(model, 200))
    (alone,) = [b for b in buckets if "embed.weight" in b.names]
    assert alone.names == ["embed.weight"] and alone.nbytes == big > 200
    assert all(b.nbytes <= 200 for b in buckets if b is not alone)


def test_buckets_are_copies_not_views() -> None:
    model = _tiny()
    (bucket,) = list(iter_buckets(model, 10**9))
    before = bucket.tensors[0].clone()
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    assert torch.equal(bucket.tensors[0], before), "a bucket must not alias the live parameters"


def test_not_keeping_yields_none_per_bucket() -> None:
    model = _tiny()
    kept = list(iter_buckets(model, 100))
    dropped = list(iter_buckets(model, 100, src_rank=1))
    assert len(dropped) == len(kept) > 1
    assert all(item is None for item in dropped)


def test_bucket_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(_tiny(), 0))


# ----------------------------------------------------------------------------- multi-rank


def _hf_model(tie: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms start at exactly 1.0: make them distinct
    model.model.register_buffer("step", torch.tensor([3, 5], dtype=torch.int64))  # persistent, integer
    return model


def rank_fsdp_buckets(tie: bool, keep_rank: int | None, bucket_bytes: int, dtype: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from shardforge.mesh import ParallelDims, build_mesh

    model = _hf_model(tie)
    reference = {n: t.detach().clone() for n, t in canonical_parameters(model)}
    order = [n for n, _ in canonical_parameters(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = build_mesh(ParallelDims(dp_shard=2), device_type="cpu").get("fsdp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert [n for n, _ in canonical_parameters(model)] == order, "sharding keeps the canonical names"
    items = list(iter_buckets(model, bucket_bytes, src_rank=keep_rank, dtype=dtype))
    return {"items": items, "reference": reference, "order": order}


@pytest.mark.parametrize(
    ("tie", "keep_rank", "bucket_bytes", "dtype"),
    [(True, 0, 4096, torch.bfloat16), (False, 1, 3000, None)],
)
def test_fsdp2_buckets_equal_unsharded(tie: bool, keep_rank: int, bucket_bytes: int, dtype: Any) -> None:
    results = get_rank_pool(2).run(rank_fsdp_buckets, tie, keep_rank, bucket_bytes, dtype, timeout_s=120)
    kept = results[keep_rank]
    other = results[1 - keep_rank]
    assert len(other["items"]) == len(kept["items"]) > 2, "both ranks walk the same buckets"
    assert all(item is None for item in other["items"])
    order = kept["order"]
    assert ("lm_head.weight" in order) is not tie, "tied head listed once"
    assert "model.step" in order and not any("inv_freq" in n for n in order)
    check_buckets(kept["items"], kept["reference"], order, bucket_bytes, dtype)


def test_every_rank_keeps_the_buckets_without_a_src_rank() -> None:
    """src_rank=None: both FSDP ranks get every bucket, equal to the unsharded weights."""
    results = get_rank_pool(2).run(rank_fsdp_buckets, False, None, 3000, torch.bfloat16, timeout_s=120)
    for result in results:
        assert len(result["items"]) > 2 and all(item is not None for item in result["items"])
        check_buckets(result["items"], result["reference"], result["order"], 3000, torch.bfloat16)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 6)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(6, 9, bias=False)
        self.register_buffer("scale", torch.full((3,), 0.5))


def _seeded_tpnet() -> tuple[TPNet, dict[str, torch.Tensor], list[str]]:
    """The same randomised TPNet on every rank, its unsharded tensors and canonical order."""
    torch.manual_seed(0)
    model = TPNet()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    reference = {n: t.detach().clone() for n, t in canonical_parameters(model)}
    return model, reference, [n for n, _ in canonical_parameters(model)]


def rank_2d_buckets(keep_rank: int, bucket_bytes: int, dtype: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from shardforge.mesh import ParallelDims, build_mesh

    model, reference, order = _seeded_tpnet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmesh = build_mesh(ParallelDims(dp_shard=2, tp=2), device_type="cpu")
    tp_mesh, dp_mesh = pmesh.get("tp"), pmesh.get("fsdp")
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    up = model.blocks[0].up.weight
    assert isinstance(up, DTensor) and up.device_mesh.ndim == 2, "a 2-D (fsdp, tp) DTensor"
    items = list(iter_buckets(model, bucket_bytes, src_rank=keep_rank, dtype=dtype))
    return {"items": items, "reference": reference, "order": order}


@pytest.mark.parametrize(("keep_rank", "dtype"), [(3, torch.bfloat16), (0, None)])
def test_2d_fsdp_tp_buckets_equal_unsharded(keep_rank: int, dtype: Any) -> None:
    results = get_rank_pool(4).run(rank_2d_buckets, keep_rank, 160, dtype, timeout_s=120)
    kept = results[keep_rank]
    for rank, result in enumerate(results):
        assert len(result["items"]) == len(kept["items"]) > 2
        if rank != keep_rank:
            assert all(item is None for item in result["items"])
    check_buckets(kept["items"], kept["reference"], kept["order"], 160, dtype)


def rank_hsdp_buckets(keep_rank: int, bucket_bytes: int, dtype: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from shardforge.mesh import ParallelDims, build_mesh

    model, reference, order = _seeded_tpnet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmesh = build_mesh(ParallelDims(dp_replicate=2, dp_shard=2), device_type="cpu")
    mesh = pmesh.get(("dp_replicate", "fsdp"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    embed = model.embed.weight
    assert isinstance(embed, DTensor) and tuple(embed.placements) == (Replicate(), Shard(0))
    assert embed.to_local().shape[0] in (4, 5), "9 rows over 2 shards: uneven chunks"
    items = list(iter_buckets(model, bucket_bytes, src_rank=keep_rank, dtype=dtype))
    return {"items": items, "reference": reference, "order": order}


@pytest.mark.parametrize(("keep_rank", "dtype"), [(2, torch.bfloat16), (1, None)])
def test_hsdp_buckets_equal_unsharded(keep_rank: int, dtype: Any) -> None:
    """HSDP: only the sender's shard group transfers; the other replica skips the parameters."""
    results = get_rank_pool(4).run(rank_hsdp_buckets, keep_rank, 200, dtype, timeout_s=120)
    kept = results[keep_rank]
    for rank, result in enumerate(results):
        assert len(result["items"]) == len(kept["items"]) > 2
        if rank != keep_rank:
            assert all(item is None for item in result["items"])
    check_buckets(kept["items"], kept["reference"], kept["order"], 200, dtype)
