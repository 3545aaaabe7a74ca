"""Policy losses beyond PPO-clip (CISPO, GMPO, SAPO, Clip-Cov, KL-Cov, GPG, REINFORCE, DPPO) against float64
references written per sequence from each paper's formula: loss value and gradient, with prompt
tokens, garbage off the mask and an all-masked row."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardforge.engine.objectives import POLICY_LOSSES, PPOActorConfig, ppo_actor_loss
from shardforge.engine.objectives.policy_loss_options import ClipCovConfig, KLCovConfig, SAPOConfig

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


def _ours(name: str, data: dict[str, torch.Tensor], aggregation: str, **options: Any) -> tuple[float, torch.Tensor]:
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


def _dppo(divergence: str, delta: float, cap: float | None = None) -> Callable[..., torch.Tensor]:
    """DPPO (Qi et al. 2026, eq. for the binary approximations): -A sg[min(r, c)] log pi on the kept tokens."""

    def per_token(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        p, q = torch.exp(lp.detach()), torch.exp(old)
        weight = torch.exp(lp - old).detach()
        if cap is not None:
            weight = torch.clamp(weight, max=cap)
        if divergence == "tv":
            keep = torch.where(adv > 0, p - q <= delta, p - q >= -delta)
        else:
            kl = q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))
            keep = torch.where(adv > 0, (kl <= delta) | (p <= q), (kl <= delta) | (p >= q))
        return -adv * weight * lp * keep

    return per_token


CASES = [
    ("dppo_tv", _dppo("tv", 0.08), {"clip_eps_low": 0.08, "clip_eps_high": 0.08}),
    ("dppo_kl", _dppo("kl", 0.01, cap=1.5), {"clip_eps_low": 0.01, "clip_eps_high": 0.01, "dual_clip": 1.5}),
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


def test_the_dppo_cases_mask_on_both_sides() -> None:
    """Over the seeds above, each divergence masks tokens of both advantage signs (else the cases test little)."""
    for name, options in [("dppo_tv", {"clip_eps_low": 0.08}), ("dppo_kl", {"clip_eps_low": 0.01})]:
        masked_pos = masked_neg = 0
        for seed in range(3):
            data = _inputs(seed)
            config = PPOActorConfig(policy_loss=name, **options)  # type: ignore[arg-type]
            old, adv = data["old"].clamp(min=-50), data["adv"].nan_to_num()
            terms = POLICY_LOSSES.get(name)(data["lp"], old, adv, MASK, CU, config)
            assert not bool(terms.clipped[MASK == 0].any())
            masked_pos += int((terms.clipped & (adv > 0)).sum())
            masked_neg += int(terms.clipped_low.sum())
        assert masked_pos > 0 and masked_neg > 0, (name, masked_pos, masked_neg)


def test_dppo_keeps_a_rare_tokens_gradient_that_the_ratio_clip_drops() -> None:
    """The paper's point: a rare token with ratio 10 but a 0.045 probability change stays in DPPO's
    trust region (PPO's clip at 1.28 drops its gradient); a likely token moving 0.7 -> 0.9 (ratio 1.29,
    TV 0.2) is masked by DPPO-TV at delta 0.1."""
    lp = torch.log(torch.tensor([0.05, 0.9], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.tensor([0.005, 0.7], dtype=torch.float64))
    adv, mask, cu = torch.tensor([1.0, 1.0], dtype=torch.float64), torch.ones(2), torch.tensor([0, 2])
    grads = {}
    for name in ("vanilla", "dppo_tv"):
        x = lp.detach().clone().requires_grad_()
        config = PPOActorConfig(
            policy_loss=name,
            clip_eps_low=0.2 if name == "vanilla" else 0.1,
            clip_eps_high=0.28 if name == "vanilla" else 0.1,
        )
        ppo_actor_loss(
            x, old_logprobs=old, advantages=adv, loss_mask=mask, cu_seqlens=cu, config=config
        ).loss.backward()
        grads[name] = x.grad
    assert grads["vanilla"][0] == 0 and grads["dppo_tv"][0] < 0  # rare token: clipped by PPO, pushed up by DPPO
    assert grads["dppo_tv"][1] == 0 and grads["vanilla"][1] == 0  # likely token: both stop it


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
    loss, grad = _ours("kl_cov", data, "token-mean", kl_cov=KLCovConfig(ratio=ratio, coef=0.5))
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
    loss, grad = _ours("clip_cov", data, "token-mean", clip_cov=ClipCovConfig(ratio=1.0, lb=lb, ub=ub))
    assert math.isclose(loss, float(ref.detach()), rel_tol=1e-12)
    assert lp.grad is not None
    torch.testing.assert_close(grad, lp.grad, rtol=1e-10, atol=1e-12)
    dropped = int((grad == 0).sum()) - int((MASK == 0).sum())
    assert dropped >= 1


def test_clip_cov_drops_at_most_its_share_and_is_reproducible() -> None:
    data = _inputs(2)
    first = _ours("clip_cov", data, "token-mean", clip_cov=ClipCovConfig(lb=-10.0, ub=10.0))
    second = _ours("clip_cov", data, "token-mean", clip_cov=ClipCovConfig(lb=-10.0, ub=10.0))
    assert torch.equal(first[1], second[1])
    vanilla = _ours("vanilla", data, "token-mean")
    changed = (first[1] != vanilla[1]).sum()
    assert int(changed) == 1  # max(int(2e-4 * 8), 1) token


@pytest.mark.parametrize(
    "name", ["cispo", "geo_mean", "sapo", "clip_cov", "kl_cov", "gpg", "reinforce", "dppo_tv", "dppo_kl"]
)
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
    names = [
        "cispo",
        "geo_mean",
        "sapo",
        "clip_cov",
        "kl_cov",
        "gpg",
        "reinforce",
        "vanilla",
        "gspo",
        "dppo_tv",
        "dppo_kl",
    ]
    for name in names:
        assert name in POLICY_LOSSES
    docs = dict(POLICY_LOSSES.describe())
    assert "MiniMax" in docs["cispo"] and "GMPO" in docs["geo_mean"] and "DPPO-Binary-TV" in docs["dppo_tv"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"clip_cov": {"ratio": 0.0}}, r"actor\.clip_cov\.ratio is a fraction of tokens in \(0, 1\]"),
        ({"kl_cov": {"ratio": 2.0}}, r"actor\.kl_cov\.ratio is a fraction of tokens in \(0, 1\]"),
        ({"clip_cov": {"lb": 5.0, "ub": 1.0}}, r"actor\.clip_cov\.lb=5\.0 must be < actor\.clip_cov\.ub"),
        ({"sapo": {"tau_neg": 0.0}}, r"actor\.sapo\.tau_pos/neg must be > 0"),
    ],
)
def test_invalid_options_say_what_is_valid(options: dict[str, dict[str, float]], match: str) -> None:
    kinds = {"clip_cov": ClipCovConfig, "kl_cov": KLCovConfig, "sapo": SAPOConfig}
    with pytest.raises(ValueError, match=match):
        PPOActorConfig(**{k: kinds[k](**v) for k, v in options.items()})  # type: ignore[arg-type]
