"""Policy losses beyond PPO-clip (CISPO, GMPO, SAPO, Clip-Cov, KL-Cov, GPG, REINFORCE) against float64
references written per sequence from each paper's formula: loss value and gradient, with prompt
tokens, garbage off the mask and an all-masked row."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from shardforge.algorithms.objectives import POLICY_LOSSES, PPOActorConfig, ppo_actor_loss

# three sequences: prompt + 3 targets, prompt + 4 targets, an all-masked row
CU = torch.tensor([0, 5, 11, 14])
MASK = torch.tensor([0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0], dtype=torch.float64)
ROWS = [[1, 2, 3, 4], [7, 8, 9, 10], []]


def _inputs(seed: int, spread: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = -1.0 + 0.2 * torch.randn(14, generator=g, dtype=torch.float64)
    old = lp + spread * torch.randn(14, generator=g, dtype=torch.float64)
    adv = torch.zeros(14, dtype=torch.float64)
    adv[1:5], adv[7:11] = 1.3, -0.7  # one advantage per sequence
    old[MASK == 0] = float("-inf")  # garbage off the mask must not leak
    adv[MASK == 0] = float("nan")
    return {"lp": lp, "old": old, "adv": adv}


def _ours(name: str, data: dict[str, torch.Tensor], aggregation: str, **options: float) -> tuple[float, torch.Tensor]:
    lp = data["lp"].clone().requires_grad_()
    config = PPOActorConfig(policy_loss=name, aggregation=aggregation, **options)  # type: ignore[arg-type]
    out = ppo_actor_loss(
        lp, old_logprobs=data["old"], advantages=data["adv"], loss_mask=MASK, cu_seqlens=CU, config=config
    )
    out.loss.backward()
    assert lp.grad is not None
    assert torch.isfinite(lp.grad).all() and bool((lp.grad[MASK == 0] == 0).all())
    return float(out.loss.detach()), lp.grad


def _reference(
    per_token: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    data: dict[str, torch.Tensor],
    aggregation: str,
) -> tuple[float, torch.Tensor]:
    """Sum per_token(lp_i, old_i, adv_i) [n_i] per sequence; token-mean or seq-mean-token-mean."""
    lp = data["lp"].clone().requires_grad_()
    terms = [per_token(lp[r], data["old"][r], data["adv"][r]) for r in ROWS if r]
    if aggregation == "token-mean":
        loss = torch.cat(terms).sum() / sum(t.numel() for t in terms)
    else:
        loss = torch.stack([t.mean() for t in terms]).mean()
    loss.backward()
    assert lp.grad is not None
    return float(loss.detach()), lp.grad


def _cispo(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    ratio = torch.exp(lp - old).detach()
    return -torch.clamp(ratio, 0.8, 1.28) * adv * lp


def _gmpo(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    # GMPO eq. (4): (prod_t clip(r_t)^{sgn A})^{1/|o|} with the min over clipped/unclipped per sign
    a = adv.mean()
    s = torch.sign(a)
    log_r = lp - old
    per_token = s * torch.minimum(s * log_r, s * log_r.clamp(-0.4, 0.4))
    seq_loss = -a * torch.exp(per_token.mean())
    return seq_loss.expand(lp.numel())  # every token carries the sequence loss


def _sapo(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    r = torch.exp(lp - old)
    out = []
    for t in range(lp.numel()):
        tau = 1.0 if adv[t] > 0 else 1.05
        out.append(-adv[t] * torch.sigmoid(tau * (r[t] - 1)) * 4 / tau)
    return torch.stack(out)


def _gpg(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    return -adv * lp


def _reinforce(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    return -adv * torch.exp(lp - old)


CASES = [
    ("cispo", _cispo, {"clip_eps_high": 0.28}),
    ("geo_mean", _gmpo, {"clip_eps_low": 0.4, "clip_eps_high": 0.4}),
    ("sapo", _sapo, {}),
    ("gpg", _gpg, {}),
    ("reinforce", _reinforce, {}),
]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(("name", "reference", "options"), CASES, ids=[c[0] for c in CASES])
def test_loss_and_gradient_match_the_paper_formula(
    name: str, reference: Callable[..., torch.Tensor], options: dict[str, float], aggregation: str
) -> None:
    for seed in range(3):
        data = _inputs(seed)
        loss, grad = _ours(name, data, aggregation, **options)
        ref_loss, ref_grad = _reference(reference, data, aggregation)
        assert math.isclose(loss, ref_loss, rel_tol=1e-12, abs_tol=1e-12), (name, loss, ref_loss)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_the_cases_clip_where_they_should() -> None:
    """The seeds above exercise the clipped branches (else the references would test little)."""
    data = _inputs(0, spread=0.5)
    r = torch.exp(data["lp"] - data["old"])[MASK != 0]
    assert bool((r > 1.28).any()) and bool((r < 0.8).any())
    assert bool(((data["lp"] - data["old"])[MASK != 0].abs() > 0.4).any())


def _cov(data: dict[str, torch.Tensor]) -> dict[int, float]:
    targets = [t for r in ROWS for t in r]
    mean_a = sum(float(data["adv"][t]) for t in targets) / len(targets)
    mean_l = sum(float(data["lp"][t]) for t in targets) / len(targets)
    return {t: (float(data["adv"][t]) - mean_a) * (float(data["lp"][t]) - mean_l) for t in targets}


def test_kl_cov_penalises_the_top_covariance_tokens() -> None:
    data = _inputs(1)
    cov = _cov(data)
    top = sorted(cov, key=cov.get, reverse=True)[:2]  # type: ignore[arg-type]
    ratio = 2 / 8 + 1e-9  # two of eight targets

    def reference(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return -adv * torch.exp(lp - old)

    lp = data["lp"].clone().requires_grad_()
    terms = []
    for t in (t for r in ROWS for t in r):
        term = reference(lp[t], data["old"][t], data["adv"][t])
        if t in top:
            term = term + 0.5 * (lp[t] - data["old"][t]).abs()
        terms.append(term)
    ref = torch.stack(terms).mean()
    ref.backward()
    loss, grad = _ours("kl_cov", data, "token-mean", kl_cov_ratio=ratio, ppo_kl_coef=0.5)
    assert math.isclose(loss, float(ref.detach()), rel_tol=1e-12)
    assert lp.grad is not None
    torch.testing.assert_close(grad, lp.grad, rtol=1e-10, atol=1e-12)


def test_clip_cov_drops_the_gradient_of_unclipped_tokens_in_the_covariance_band() -> None:
    data = _inputs(2)
    cov = _cov(data)
    values = sorted(cov.values())
    lb, ub = values[2] - 1e-9, values[6] + 1e-9  # five candidates by covariance
    r = torch.exp(data["lp"] - data["old"])
    lp = data["lp"].clone().requires_grad_()
    terms = []
    for t in (t for r_ in ROWS for t in r_):
        a = data["adv"][t]
        ratio = torch.exp(lp[t] - data["old"][t])
        l_clip = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
        was_clipped = bool(-a * r[t].clamp(0.8, 1.2) > -a * r[t])
        terms.append(l_clip * 0.0 if (lb < cov[t] < ub and not was_clipped) else l_clip)
    ref = torch.stack(terms).mean()
    ref.backward()
    # ratio 1: every candidate is dropped, so the random choice does not matter
    loss, grad = _ours("clip_cov", data, "token-mean", clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
    assert math.isclose(loss, float(ref.detach()), rel_tol=1e-12)
    assert lp.grad is not None
    torch.testing.assert_close(grad, lp.grad, rtol=1e-10, atol=1e-12)
    dropped = int((grad == 0).sum()) - int((MASK == 0).sum())
    assert dropped >= 1


def test_clip_cov_drops_at_most_its_share_and_is_reproducible() -> None:
    data = _inputs(2)
    first = _ours("clip_cov", data, "token-mean", clip_cov_lb=-10.0, clip_cov_ub=10.0)
    second = _ours("clip_cov", data, "token-mean", clip_cov_lb=-10.0, clip_cov_ub=10.0)
    assert torch.equal(first[1], second[1])
    vanilla = _ours("vanilla", data, "token-mean")
    changed = (first[1] != vanilla[1]).sum()
    assert int(changed) == 1  # max(int(2e-4 * 8), 1) token


@pytest.mark.parametrize("name", ["cispo", "geo_mean", "sapo", "clip_cov", "kl_cov", "gpg", "reinforce"])
def test_no_targets_gives_zero_loss_and_gradient(name: str) -> None:
    lp = torch.full((5,), -1.0, dtype=torch.float64, requires_grad=True)
    out = ppo_actor_loss(
        lp,
        old_logprobs=torch.full((5,), float("-inf")),
        advantages=torch.full((5,), float("nan")),
        loss_mask=torch.zeros(5),
        cu_seqlens=torch.tensor([0, 2, 5]),
        config=PPOActorConfig(policy_loss=name),
    )
    out.loss_sum.backward()
    assert float(out.loss.detach()) == 0.0 and float(out.loss_weight) == 0.0
    assert lp.grad is not None and bool((lp.grad == 0).all())


def test_registered_under_verl_names_with_docs() -> None:
    for name in ["cispo", "geo_mean", "sapo", "clip_cov", "kl_cov", "gpg", "reinforce", "vanilla", "gspo"]:
        assert name in POLICY_LOSSES
    docs = dict(POLICY_LOSSES.describe())
    assert "MiniMax" in docs["cispo"] and "GMPO" in docs["geo_mean"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"clip_cov_ratio": 0.0}, "clip_cov_ratio and kl_cov_ratio"),
        ({"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "clip_cov_lb=5.0 must be < clip_cov_ub"),
        ({"sapo_tau_neg": 0.0}, "sapo_tau_pos/neg > 0"),
    ],
)
def test_invalid_options_say_what_is_valid(options: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PPOActorConfig(**options)  # type: ignore[arg-type]
