"""Direct preference optimisation losses on (chosen, rejected) pairs: DPO, IPO, SimPO, hinge.

Per pair, from the policy's and the reference's summed response log-probs (``pi_c``, ``pi_r``,
``ref_c``, ``ref_r``; IPO and SimPO use per-token means, as TRL does):

- ``sigmoid`` (DPO, Rafailov et al. 2023): ``h = (pi_c - ref_c) - (pi_r - ref_r)``,
  ``loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`` (``eps`` = label smoothing,
  the conservative DPO of Mitchell 2023).
- ``ipo`` (IPO, Azar et al. 2023): ``h`` on mean log-probs, ``loss = (h - 1 / (2 beta))^2``.
- ``hinge`` (SLiC-HF, Zhao et al. 2023): ``loss = max(0, 1 - beta h)``.
- ``simpo`` (SimPO, Meng et al. 2024; reference-free): ``h = mean pi_c - mean pi_r - gamma / beta``,
  ``loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``.

The implicit rewards reported are ``beta (pi - ref)`` (sums; means for IPO), ``beta * mean pi`` for
SimPO, as TRL reports them. Losses are summed over pairs; the engine divides by the global number
of pairs, so any micro-batching or data-parallel split gives the same update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardforge.core.registry import Registry
from shardforge.engine.batching import check_cu_seqlens, check_finite
from shardforge.engine.objectives.stats import LossOutput

__all__ = [
    "PREFERENCE_LOSSES",
    "PreferenceLossConfig",
    "PreferenceLossSpec",
    "check_preference_config",
    "preference_loss",
    "sequence_logprobs",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class PreferenceLossConfig:
    """Hyper-parameters of the preference losses (names as TRL's DPOConfig / CPOConfig)."""

    loss_type: str = "sigmoid"
    """A name registered in `PREFERENCE_LOSSES`: sigmoid (DPO), ipo, hinge, simpo."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward (DPO's beta; IPO's regulariser is 1 / (2 beta))."""
    label_smoothing: float = 0.0
    """Probability that a label is flipped (conservative DPO); sigmoid and simpo only; in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (the loss subtracts gamma / beta from the mean log-prob gap)."""


@dataclass(frozen=True, slots=True)
class PreferenceLossSpec:
    """A registered preference loss: its per-pair function and what it needs."""

    fn: Callable[[torch.Tensor, torch.Tensor, PreferenceLossConfig], torch.Tensor]
    """(chosen term [P], rejected term [P], config) -> per-pair loss [P]; the terms are defined below."""
    length_normalised: bool
    """Use per-token mean log-probs instead of sums."""
    needs_reference: bool
    """Terms are policy - reference log-probs (True) or the policy's alone (reference-free)."""


PREFERENCE_LOSSES: Registry[PreferenceLossSpec] = Registry("preference loss")
"""``shardforge train dpo``'s ``loss_type``; register ``PreferenceLossSpec`` entries to add one."""


def _smoothed_sigmoid(h: torch.Tensor, config: PreferenceLossConfig) -> torch.Tensor:
    eps = config.label_smoothing
    return -(1.0 - eps) * F.logsigmoid(config.beta * h) - eps * F.logsigmoid(-config.beta * h)


PREFERENCE_LOSSES.register(
    "sigmoid", doc="DPO (Rafailov et al. 2023): -log sigmoid(beta h), h = chosen - rejected log-ratio to ref"
)(PreferenceLossSpec(lambda c, r, cfg: _smoothed_sigmoid(c - r, cfg), length_normalised=False, needs_reference=True))
PREFERENCE_LOSSES.register("ipo", doc="IPO (Azar et al. 2023): (h - 1/(2 beta))^2 on per-token mean log-ratios")(
    PreferenceLossSpec(
        lambda c, r, cfg: (c - r - 1.0 / (2.0 * cfg.beta)) ** 2, length_normalised=True, needs_reference=True
    )
)
PREFERENCE_LOSSES.register("hinge", doc="SLiC-HF (Zhao et al. 2023): max(0, 1 - beta h)")(
    PreferenceLossSpec(
        lambda c, r, cfg: torch.relu(1.0 - cfg.beta * (c - r)), length_normalised=False, needs_reference=True
    )
)
PREFERENCE_LOSSES.register(
    "simpo", doc="SimPO (Meng et al. 2024): -log sigmoid(beta (mean lp_c - mean lp_r) - gamma), no reference"
)(
    PreferenceLossSpec(
        lambda c, r, cfg: _smoothed_sigmoid(c - r - cfg.simpo_gamma / cfg.beta, cfg),
        length_normalised=True,
        needs_reference=False,
    )
)

PREFERENCE_LOSSES.add("dpo", PREFERENCE_LOSSES.get("sigmoid"), doc="alias of sigmoid (TRL's name is sigmoid)")


def check_preference_config(config: PreferenceLossConfig) -> PreferenceLossSpec:
    """The registered spec of ``config.loss_type``; `ValueError` on a bad name or value."""
    spec = PREFERENCE_LOSSES.get(config.loss_type)
    if not config.beta > 0:
        raise ValueError(f"beta must be > 0, got {config.beta}")
    if not 0.0 <= config.label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {config.label_smoothing}")
    if config.label_smoothing and config.loss_type not in ("sigmoid", "simpo"):
        raise ValueError(f"label_smoothing applies to loss_type sigmoid or simpo, not {config.loss_type!r}")
    return spec


def sequence_logprobs(
    logprobs_T: torch.Tensor, loss_mask_T: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] summed log-probs over each sequence's target tokens, and [N] their counts."""
    check_cu_seqlens(cu_seqlens, logprobs_T.shape[0])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=logprobs_T.device), lengths)
    mask = loss_mask_T.to(logprobs_T.dtype)
    sums = torch.zeros(lengths.numel(), dtype=logprobs_T.dtype, device=logprobs_T.device)
    sums = sums.index_add(0, seq_id, logprobs_T * mask)
    counts = torch.zeros_like(sums).index_add(0, seq_id, mask)
    return sums, counts


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_counts: torch.Tensor,
    rejected_counts: torch.Tensor,
    config: PreferenceLossConfig,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
) -> LossOutput:
    """Summed loss over P pairs from summed response log-probs [P] (and their token counts [P]).

    Stats (pair sums; divide by ``num_pairs``), TRL's names: ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/margins``, ``rewards/accuracies`` (chosen reward > rejected, ties wrong), ``logps/chosen``,
    ``logps/rejected`` (summed policy log-probs).
    """
    spec = check_preference_config(config)
    if spec.needs_reference and (ref_chosen is None or ref_rejected is None):
        raise ValueError(f"loss_type={config.loss_type!r} needs the reference model's log-probs")
    if bool((chosen_counts <= 0).any() or (rejected_counts <= 0).any()):
        raise ValueError("a chosen or rejected response has no target tokens; drop empty responses")
    check_finite("policy log-probs", torch.cat([policy_chosen, policy_rejected]).detach())

    def term(policy: torch.Tensor, ref: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
        value = policy - ref.detach() if (spec.needs_reference and ref is not None) else policy
        return value / counts if spec.length_normalised else value

    chosen = term(policy_chosen, ref_chosen, chosen_counts)
    rejected = term(policy_rejected, ref_rejected, rejected_counts)
    loss_sum = spec.fn(chosen, rejected, config).sum()
    num_pairs = torch.tensor(float(chosen.numel()), dtype=torch.float64)
    with torch.no_grad():
        reward_c, reward_r = config.beta * chosen.double(), config.beta * rejected.double()
        stats = {
            "num_pairs": num_pairs,
            "loss_sum": loss_sum.detach().double().cpu(),
            "loss_weight": num_pairs,
            "rewards/chosen": reward_c.sum().cpu(),
            "rewards/rejected": reward_r.sum().cpu(),
            "rewards/margins": (reward_c - reward_r).sum().cpu(),
            "rewards/accuracies": (reward_c > reward_r).double().sum().cpu(),
            "logps/chosen": policy_chosen.detach().double().sum().cpu(),
            "logps/rejected": policy_rejected.detach().double().sum().cpu(),
        }
    return LossOutput(loss_sum=loss_sum, loss_weight=num_pairs, stats=stats)
