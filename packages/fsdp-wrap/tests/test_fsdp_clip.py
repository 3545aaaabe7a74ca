"""`clip_grad_norm_` / `total_grad_norm` on DTensor gradients equal torch's on the unsharded model.

The FSDP runs give every rank a different slice of one batch (see test_fsdp_parity.py), so
the sharded gradients equal the unsharded model's gradients on the whole batch; torch's own
`torch.nn.utils.clip_grad_norm_` on that model is the reference for the norm and the clipped
gradients.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.fsdp_wrap import clip_grad_norm_, total_grad_norm
from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
SEQ_LEN = 12
SEQS_PER_RANK = 2
INF = math.inf

# float32: the sharded norm sums per-shard partial norms (and per-group totals) in another
# order than torch's single pass, and the gradients themselves carry the sharded-vs-unsharded
# differences of test_fsdp_parity.py (a few ulps). Counting a replica twice or skipping a
# shard changes the norm by tens of percent.
NORM_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def tiny_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config())


def _mixed_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Full values (params and grads) for the mixed-placement test; identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen)
        for name, shape in [("a", (5, 4)), ("ga", (5, 4)), ("b", (7,)), ("gb", (7,)), ("c", (3,)), ("gc", (3,))]
    }


# ---------------------------------------------------------------------------------------------- rank functions
def _sharded_clip(
    layout: str,
    state: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    max_norm: float,
    norm_type: float,
    inject: float | None,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from shardforge.fsdp_wrap import apply_fsdp, load_full_state_dict
    from shardforge.mesh import ParallelDims, build_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    if layout == "hsdp":
        mesh = build_mesh(ParallelDims(dp_replicate=2, dp_shard=2)).get(("dp_replicate", "fsdp"))
    else:
        mesh = build_mesh(ParallelDims(dp_shard=world)).get("fsdp")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_fsdp(model, mesh)
    load_full_state_dict(model, state if rank == 0 else None, device="cpu", buffers=buffers if rank == 0 else None)
    chunk = input_ids.chunk(world)[rank]
    model(input_ids=chunk, labels=chunk).loss.backward()
    if inject is not None and rank == 1:  # a bad value on one rank's shard only
        model.model.layers[0].self_attn.q_proj.weight.grad.to_local().view(-1)[0] = inject
    before = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    norm_only = total_grad_norm(model.parameters(), norm_type=norm_type)
    total = clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
    return {
        "norm_only": norm_only,
        "total": total,
        "before": before,
        "after": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
    }


def _mixed_placements(norm_type: float, max_norm: float) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    t = _mixed_tensors(seed=3)
    sharded = torch.nn.Parameter(distribute_tensor(t["a"], mesh, [Shard(0)]))  # 5 rows on 2 ranks: uneven
    sharded.grad = distribute_tensor(t["ga"], mesh, [Shard(0)])
    replicated = torch.nn.Parameter(distribute_tensor(t["b"], mesh, [Replicate()]))
    replicated.grad = distribute_tensor(t["gb"], mesh, [Replicate()])
    plain = torch.nn.Parameter(t["c"].clone())  # an ordinary tensor, identical on every rank
    plain.grad = t["gc"].clone()
    no_grad = torch.nn.Parameter(torch.ones(4))
    params = [sharded, replicated, plain, no_grad]
    norm = total_grad_norm(params, norm_type=norm_type)
    total = clip_grad_norm_(iter(params), max_norm, norm_type=norm_type)  # any iterable, e.g. a generator
    full = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params[:3]]
    return {"norm": norm, "total": total, "grads": full, "no_grad": no_grad.grad}


def _pipeline_stages(norm_type: float, bad: float | None) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh

    pp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    rank = dist.get_rank()
    param = torch.nn.Parameter(torch.zeros(3))  # each stage owns different parameters
    param.grad = torch.tensor([3.0, -4.0, 0.0]) if rank == 0 else torch.tensor([0.0, 12.0, -1.0])
    if bad is not None and rank == 1:
        param.grad[2] = bad
    return total_grad_norm([param], norm_type=norm_type, pp_mesh=pp_mesh)


# ---------------------------------------------------------------------------------------------- helpers
def _reference(world: int) -> tuple[torch.nn.Module, torch.Tensor]:
    model = build_model()
    torch.manual_seed(1234)
    input_ids = torch.randint(0, VOCAB, (world * SEQS_PER_RANK, SEQ_LEN))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    return model, input_ids


def _inputs(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return copy.deepcopy(model.state_dict()), {n: b.clone() for n, b in model.named_buffers()}


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    ("layout", "world", "norm_type", "clips"),
    [
        ("fsdp", 2, 2.0, True),
        ("fsdp", 2, INF, True),
        ("fsdp", 2, 2.0, False),
        ("hsdp", 4, 2.0, True),
        ("hsdp", 4, INF, True),
    ],
    ids=["fsdp2-l2", "fsdp2-inf", "fsdp2-l2-noclip", "hsdp2x2-l2", "hsdp2x2-inf"],
)
def test_clip_on_sharded_grads_matches_torch_unsharded(layout: str, world: int, norm_type: float, clips: bool) -> None:
    model, input_ids = _reference(world)
    state, buffers = _inputs(model)
    unclipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type=norm_type)
    max_norm = float(norm) * (0.25 if clips else 4.0)
    ref_total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    if clips:  # the reference really clipped, so the comparison below tests the scaling
        assert not torch.allclose(ref_grads["lm_head.weight"], unclipped["lm_head.weight"])

    results = get_rank_pool(world).run(_sharded_clip, layout, state, buffers, input_ids, max_norm, norm_type, None)
    for r in results:
        assert r["total"].dtype == torch.float32 and r["total"].dim() == 0
        torch.testing.assert_close(r["norm_only"], ref_total, **NORM_TOL)
        torch.testing.assert_close(r["total"], ref_total, **NORM_TOL)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(r["before"][name], unclipped[name], **GRAD_TOL)
            torch.testing.assert_close(r["after"][name], grad, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    ("bad", "norm_type"),
    [(math.nan, 2.0), (INF, 2.0), (math.nan, INF), (INF, INF)],
    ids=["nan-l2", "inf-l2", "nan-inf", "inf-inf"],
)
def test_non_finite_grad_returns_non_finite_norm_and_leaves_grads(bad: float, norm_type: float) -> None:
    model, input_ids = _reference(2)
    state, buffers = _inputs(model)
    results = get_rank_pool(2).run(_sharded_clip, "fsdp", state, buffers, input_ids, 1e-3, norm_type, bad)
    for r in results:  # rank 0's shards are finite: only a correct reduction makes its norm non-finite
        assert not torch.isfinite(r["total"]), r["total"]
        for name, grad in r["before"].items():
            torch.testing.assert_close(r["after"][name], grad, rtol=0, atol=0, equal_nan=True)
        assert not torch.isfinite(r["after"]["model.layers.0.self_attn.q_proj.weight"]).all()


@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0], ids=["l2", "inf", "l1"])
def test_replicated_dtensor_counted_once(norm_type: float) -> None:
    t = _mixed_tensors(seed=3)
    expected = torch.linalg.vector_norm(torch.cat([t["ga"].flatten(), t["gb"], t["gc"]]), ord=norm_type)
    double_counted = torch.linalg.vector_norm(torch.cat([t["ga"].flatten(), t["gb"], t["gb"], t["gc"]]), ord=norm_type)
    if norm_type != INF:
        assert not torch.allclose(expected, double_counted)  # the test can tell the two apart
    max_norm = float(expected) / 2
    coef = max_norm / (float(expected) + 1e-6)
    for r in get_rank_pool(2).run(_mixed_placements, norm_type, max_norm):
        torch.testing.assert_close(r["norm"], expected, **NORM_TOL)
        torch.testing.assert_close(r["total"], expected, **NORM_TOL)
        for got, key in zip(r["grads"], ["ga", "gb", "gc"]):
            torch.testing.assert_close(got, t[key] * coef, **GRAD_TOL)
        assert r["no_grad"] is None


# Stage 0 holds g = (3, -4, 0), stage 1 holds g = (0, 12, -1): the L2 norm over both stages is
# sqrt(9 + 16 + 144 + 1), the inf-norm is 12. Either stage alone would give 5 or sqrt(145).
@pytest.mark.parametrize(("norm_type", "expected"), [(2.0, math.sqrt(170.0)), (INF, 12.0)], ids=["l2", "inf"])
def test_pipeline_stages_are_combined(norm_type: float, expected: float) -> None:
    for total in get_rank_pool(2).run(_pipeline_stages, norm_type, None):
        torch.testing.assert_close(total, torch.tensor(expected), **NORM_TOL)


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
@pytest.mark.parametrize("bad", [math.nan, INF], ids=["nan", "inf"])
def test_pipeline_stage_non_finite_reaches_every_stage(norm_type: float, bad: float) -> None:
    for total in get_rank_pool(2).run(_pipeline_stages, norm_type, bad):
        assert not torch.isfinite(total), total


@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0], ids=["l2", "inf", "l1"])
@pytest.mark.parametrize("max_norm", [0.1, 100.0], ids=["clips", "noclip"])
def test_plain_tensors_match_torch(norm_type: float, max_norm: float) -> None:
    """Without DTensors (one process), both functions behave like torch's clip_grad_norm_."""
    ours, ref = build_model(), build_model()
    torch.manual_seed(5)
    x = torch.randint(0, VOCAB, (2, SEQ_LEN))
    for model in (ours, ref):
        model(input_ids=x, labels=x).loss.backward()
    torch.testing.assert_close(
        total_grad_norm(ours.parameters(), norm_type=norm_type),
        torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type=norm_type),
        rtol=1e-6,
        atol=0,
    )
    total = clip_grad_norm_(ours.parameters(), max_norm, norm_type=norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_no_grads_gives_zero_norm() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    assert total_grad_norm(params).item() == 0.0
    assert clip_grad_norm_(params, 1.0).item() == 0.0
    assert params[0].grad is None
