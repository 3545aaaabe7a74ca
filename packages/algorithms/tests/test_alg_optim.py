"""AdamW parameter groups and the warmup + constant/linear/cosine learning-rate factor."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardforge.engine import OptimizerConfig, SchedulerConfig
from shardforge.engine.optim import build_optimizer, build_scheduler, fused_by_default, lr_factor


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.LayerNorm(3))


def test_matrices_decay_vectors_do_not():
    model = _model()
    opt = build_optimizer(model, OptimizerConfig(lr=0.5, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[1].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[1].bias), id(model[2].weight), id(model[2].bias)}
    assert all(g["lr"] == 0.5 and g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in opt.param_groups)


def test_frozen_params_and_empty_groups_are_left_out():
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False))
    model[0].weight.requires_grad_(False)
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.01))
    assert len(opt.param_groups) == 1
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(model[1].weight)]


def test_weight_decay_changes_matrices_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3))
    before_w, before_b = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    opt = build_optimizer(model, OptimizerConfig(lr=0.1, weight_decay=0.5))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: only decay can move a parameter
    opt.step()
    torch.testing.assert_close(model[0].weight.detach(), before_w * (1 - 0.1 * 0.5))
    torch.testing.assert_close(model[0].bias.detach(), before_b)


@pytest.mark.parametrize(
    ("step", "expected"),
    [(0, 0.25), (1, 0.5), (2, 0.75), (3, 1.0), (4, 1.0), (1000, 1.0)],
)
def test_constant_with_warmup(step, expected):
    assert lr_factor(step, SchedulerConfig(kind="constant", warmup_steps=4)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("step", "expected"),
    # warmup 2, then 10 decay steps from 1.0 to 0.1
    [(0, 0.5), (1, 1.0), (2, 1.0), (7, 0.55), (9, 0.37), (12, 0.1), (50, 0.1)],
)
def test_linear_with_warmup(step, expected):
    config = SchedulerConfig(kind="linear", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert lr_factor(step, config) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 1.0 / 3),
        (2, 1.0),  # last warmup step: the peak
        (3, 1.0),  # decay starts at progress 0
        (4, 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 8))),  # progress 1/8
        (7, 0.6),  # half way: (1 + 0.2) / 2
        (11, 0.2),
        (99, 0.2),
    ],
)
def test_cosine_with_warmup(step, expected):
    config = SchedulerConfig(kind="cosine", warmup_steps=3, total_steps=11, min_lr_ratio=0.2)
    assert lr_factor(step, config) == pytest.approx(expected)


def test_cosine_without_warmup_hand_values():
    config = SchedulerConfig(kind="cosine", warmup_steps=0, total_steps=10)
    assert lr_factor(0, config) == pytest.approx(1.0)
    assert lr_factor(2, config) == pytest.approx(0.9045084971874737)
    assert lr_factor(5, config) == pytest.approx(0.5)
    assert lr_factor(10, config) == pytest.approx(0.0, abs=1e-12)


def test_bad_kind_raises():
    config = SchedulerConfig(kind="exponential", warmup_steps=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown scheduler kind 'exponential'"):
        lr_factor(5, config)
    opt = build_optimizer(_model(), OptimizerConfig())
    with pytest.raises(ValueError, match="valid: 'constant', 'linear', 'cosine'"):
        build_scheduler(opt, config)


def test_scheduler_follows_lr_factor():
    config = SchedulerConfig(kind="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.0)
    opt = build_optimizer(_model(), OptimizerConfig(lr=2.0))
    sched = build_scheduler(opt, config)
    seen = []
    for _ in range(7):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1.0, 2.0, 2.0, 1.5, 1.0, 0.5, 0.0])


def test_fused_is_the_default_for_float_params_and_the_loop_stays_selectable():
    from shardforge.memory import AnyPrecisionAdamW

    model = nn.Linear(4, 4)
    default = build_optimizer(model, OptimizerConfig())
    assert default.defaults["fused"] is True  # CPU float parameters: the fused kernel, on every layout
    loop = build_optimizer(model, OptimizerConfig(fused=False))
    assert loop.defaults["foreach"] is False and not loop.defaults["fused"]
    assert not fused_by_default([nn.Parameter(torch.zeros(2, dtype=torch.int32), requires_grad=False)])
    anyp = build_optimizer(model, OptimizerConfig(name="anyprecision_adamw", fused=False))
    assert isinstance(anyp, AnyPrecisionAdamW) and anyp.fused is False
    assert build_optimizer(model, OptimizerConfig(name="anyprecision_adamw")).fused is None


def test_fused_adamw_rounds_a_shard_as_the_whole_tensor():
    """Why every layout may fuse: an FSDP/TP shard's entries get the same bits as in world 1's whole
    tensor (the kernel's vector body and scalar tail round alike, whatever the offset), so layouts compared
    in the parity tests still agree exactly. If torch breaks this, parity tests need `fused: false`."""
    gen = torch.Generator().manual_seed(0)
    n = 1037  # odd: the cuts below put a shard's start and end in the vector body or the scalar tail
    weights = torch.randn(n, generator=gen)
    scales = 10.0 ** torch.randint(-8, 2, (3, n), generator=gen).float()  # near-zero gradients too
    grads = torch.randn(3, n, generator=gen) * scales

    def train(lo: int, hi: int, fused: bool) -> torch.Tensor:
        param = nn.Parameter(weights[lo:hi].clone())
        opt = torch.optim.AdamW(
            [param], lr=1e-2, weight_decay=0.1, **({"fused": True} if fused else {"foreach": False})
        )
        for grad in grads:
            param.grad = grad[lo:hi].clone()
            opt.step()
        return param.detach()

    whole = train(0, n, fused=True)
    for cut in (1, 3, 7, 13, 100, 517, 518, 600):
        assert torch.equal(torch.cat([train(0, cut, True), train(cut, n, True)]), whole), cut
    assert not torch.equal(train(0, n, fused=False), whole)  # the loop rounds differently: never mix them
