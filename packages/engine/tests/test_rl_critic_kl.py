"""`ppo_critic_loss` and `kl_estimate` against loops over tokens written from the formulas."""

from __future__ import annotations

import math

import pytest
import torch

from shardforge.engine.objectives import (
    PPOCriticConfig,
    PPOCriticLossFn,
    kl_estimate,
    ppo_critic_loss,
    summarize_stats,
)


def make_case(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = (torch.rand(total, generator=gen) < 0.75).float()
    mask[cu[1].item() : cu[2].item()] = 0.0  # an all-masked row
    old = torch.randn(total, generator=gen)
    return {
        "values": old + 0.4 * torch.randn(total, generator=gen),
        "old": old,
        "returns": old + 1.5 * torch.randn(total, generator=gen),
        "mask": mask,
        "cu": cu,
    }


def _f(error: float, cfg: PPOCriticConfig) -> float:
    if cfg.loss_type == "mse":
        return 0.5 * error**2
    d = cfg.huber_delta
    return 0.5 * error**2 if abs(error) <= d else d * (abs(error) - 0.5 * d)


def _df(error: float, cfg: PPOCriticConfig) -> float:
    if cfg.loss_type == "mse" or abs(error) <= cfg.huber_delta:
        return error
    return math.copysign(cfg.huber_delta, error)


def reference_critic(case, cfg: PPOCriticConfig) -> tuple[float, list[float], int]:
    """Token-mean loss, d loss / d v per token, and the number of tokens where the clipped term won."""
    mask, v, old, ret = case["mask"], case["values"], case["old"], case["returns"]
    total, n, clipped = 0.0, int(mask.sum()), 0
    grads = [0.0] * len(v)
    for t in range(len(v)):
        if mask[t] == 0:
            continue
        x, x_old, target = float(v[t]), float(old[t]), float(ret[t])
        plain = _f(x - target, cfg)
        grad = _df(x - target, cfg)
        if cfg.value_clip is not None:
            inside = abs(x - x_old) < cfg.value_clip
            x_clip = x_old + min(max(x - x_old, -cfg.value_clip), cfg.value_clip)
            clip_term = _f(x_clip - target, cfg)
            if clip_term > plain:
                clipped += 1
                plain = clip_term
                # d v_clip / d v is 1 inside the clip range and 0 outside
                grad = _df(x_clip - target, cfg) if inside else 0.0
        total += plain
        grads[t] = grad / n
    return total / n, grads, clipped


@pytest.mark.parametrize("loss_type", ["mse", "huber"])
@pytest.mark.parametrize("value_clip", [0.2, None])
def test_critic_loss_and_gradient_match_reference(loss_type: str, value_clip: float | None) -> None:
    case = make_case([5, 3, 7, 1, 6], seed=1)
    cfg = PPOCriticConfig(loss_type=loss_type, value_clip=value_clip, huber_delta=0.7)
    values = case["values"].clone().requires_grad_(True)
    out = ppo_critic_loss(
        values,
        old_values=case["old"],
        returns=case["returns"],
        loss_mask=case["mask"],
        cu_seqlens=case["cu"],
        config=cfg,
    )
    out.loss.backward()
    expected, grads, clipped = reference_critic(case, cfg)
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(values.grad, torch.tensor(grads, dtype=torch.float32), rtol=1e-5, atol=1e-7)
    stats = summarize_stats(out.stats)
    assert stats["value_clip_frac"] == pytest.approx(clipped / case["mask"].sum().item())
    if value_clip is not None:
        assert 0 < clipped < case["mask"].sum()
    assert stats["loss"] == pytest.approx(expected, rel=1e-5)


def test_clipped_value_region_has_zero_gradient() -> None:
    # v moved from 0 to 1 (beyond eps = 0.2) away from the return 0.1: the clipped error (0.1) is
    # smaller, so the unclipped one is used and pulls v back; moved towards a return of 2.0: the clipped
    # error (1.8) is larger, so the loss is constant in v.
    values = torch.tensor([0.0, 1.0, 1.0], requires_grad=True)
    out = ppo_critic_loss(
        values,
        old_values=torch.zeros(3),
        returns=torch.tensor([0.0, 0.1, 2.0]),
        loss_mask=torch.tensor([0.0, 1.0, 1.0]),
        cu_seqlens=torch.tensor([0, 1, 3]),
    )
    out.loss.backward()
    assert values.grad.tolist() == pytest.approx([0.0, 0.9 / 2, 0.0])
    assert float(out.loss.detach()) == pytest.approx((0.5 * 0.81 + 0.5 * 1.8**2) / 2)
    assert summarize_stats(out.stats)["value_clip_frac"] == 0.5


def test_critic_without_targets_is_zero_and_errors_are_clear() -> None:
    values = torch.ones(3, requires_grad=True)
    out = ppo_critic_loss(
        values,
        old_values=torch.full((3,), float("nan")),
        returns=torch.zeros(3),
        loss_mask=torch.zeros(3),
        cu_seqlens=torch.tensor([0, 3]),
    )
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and values.grad.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"returns has shape \(2,\)"):
        ppo_critic_loss(
            values,
            old_values=torch.zeros(3),
            returns=torch.zeros(2),
            loss_mask=torch.ones(3),
            cu_seqlens=torch.tensor([0, 3]),
        )
    with pytest.raises(ValueError, match="returns holds 1 non-finite"):
        ppo_critic_loss(
            values,
            old_values=torch.zeros(3),
            returns=torch.tensor([0.0, float("inf"), 0.0]),
            loss_mask=torch.ones(3),
            cu_seqlens=torch.tensor([0, 3]),
        )
    with pytest.raises(ValueError, match="valid: \\['mse', 'huber'\\]"):
        PPOCriticConfig(loss_type="l1")
    with pytest.raises(ValueError, match="value_clip must be > 0"):
        PPOCriticConfig(value_clip=0.0)


def test_critic_loss_fn_reads_extras() -> None:
    from shardforge.engine import pack_sequences

    batch = pack_sequences([[1, 2, 3], [4, 5]])
    batch.extras = {"old_values": torch.zeros(5), "returns": torch.ones(5)}
    fn = PPOCriticLossFn(PPOCriticConfig(value_clip=None))
    loss = fn(torch.zeros(5, requires_grad=True), batch)
    assert float(loss.detach()) == pytest.approx(0.5 * 3) and float(fn.loss_weight(batch)) == 3
    assert summarize_stats(fn.pop_stats())["returns"] == 1.0


# ------------------------------------------------------------------ KL estimators
def test_kl_estimators_match_the_formulas() -> None:
    gen = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(50, generator=gen) * 4, -torch.rand(50, generator=gen) * 4
    for t in range(50):
        log_r = float(ref[t] - lp[t])  # r = pi_ref / pi
        expected = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - 1 - log_r}
        for name, value in expected.items():
            assert float(kl_estimate(lp, ref, name)[t]) == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert (kl_estimate(lp, ref, "k2") >= 0).all() and (kl_estimate(lp, ref, "k3") >= 0).all()


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(6, generator=gen), 0)
    q = torch.softmax(torch.randn(6, generator=gen), 0)
    true_kl = float((p * (p / q).log()).sum())
    samples = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    lp, ref = p.log()[samples].double(), q.log()[samples].double()
    for name in ("k1", "k3"):
        # 400k samples: standard errors are ~1e-3 for these distributions
        assert float(kl_estimate(lp, ref, name).mean()) == pytest.approx(true_kl, abs=5e-3)


def test_kl_gradient_flows_only_through_logprobs() -> None:
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], requires_grad=True)
    kl_estimate(lp, ref, "k3").sum().backward()
    # d/d lp [exp(ref - lp) - 1 - (ref - lp)] = 1 - exp(ref - lp)
    assert lp.grad.tolist() == pytest.approx([1 - math.exp(-0.5), 1 - math.exp(1.0)])
    assert ref.grad is None
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        kl_estimate(lp, ref, "k9")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(lp, ref[:1])
