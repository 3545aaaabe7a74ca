"""Bradley-Terry reward-model loss on chosen/rejected pairs.

P(chosen > rejected) = sigmoid(s_c - s_r) (Bradley & Terry 1952; InstructGPT's RM loss).
The loss of a pair is ``-log sigmoid(s_c - s_r - margin)`` (the optional margin is
Llama 2's); the engine contract is a sum over pairs divided by the global number of pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardforge.engine.batching import check_cu_seqlens, check_finite
from shardforge.engine.objectives.stats import LossOutput

__all__ = ["bradley_terry_loss", "last_token_scores"]


def last_token_scores(values_T: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] the value-head output at each sequence's last token (the reward model's score)."""
    check_cu_seqlens(cu_seqlens, values_T.shape[0])
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths == 0).any()):
        raise ValueError(f"sequence(s) {(lengths == 0).nonzero().flatten().tolist()} are empty and have no score")
    return values_T[cu_seqlens[1:].long() - 1]


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    *,
    margin: torch.Tensor | float | None = None,
) -> LossOutput:
    """Summed Bradley-Terry loss over P pairs, weight P, and pair-sum stats.

    Stats (divide by ``num_pairs`` with ``summarize_stats(stats, per="num_pairs")``):
    ``accuracy`` (pairs with s_c > s_r strictly; ties count as wrong), ``chosen_score``,
    ``rejected_score``, ``score_gap``.
    """
    if chosen_scores.dim() != 1 or chosen_scores.shape != rejected_scores.shape:
        raise ValueError(
            f"chosen_scores and rejected_scores must be 1-D with one score per pair; got "
            f"{tuple(chosen_scores.shape)} and {tuple(rejected_scores.shape)}"
        )
    check_finite("chosen_scores", chosen_scores.detach())
    check_finite("rejected_scores", rejected_scores.detach())
    gap = chosen_scores - rejected_scores
    if margin is not None:
        margin_t = torch.as_tensor(margin, dtype=gap.dtype, device=gap.device)
        if margin_t.dim() != 0 and margin_t.shape != gap.shape:
            raise ValueError(f"margin must be a scalar or one value per pair {tuple(gap.shape)}")
        gap_for_loss = gap - margin_t.detach()
    else:
        gap_for_loss = gap
    loss_sum = -F.logsigmoid(gap_for_loss).sum()
    num_pairs = torch.tensor(float(gap.numel()), dtype=torch.float64)
    with torch.no_grad():
        stats = {
            "num_pairs": num_pairs,
            "loss_sum": loss_sum.detach().double().cpu(),
            "loss_weight": num_pairs,
            "accuracy": (gap > 0).sum().double().cpu(),
            "chosen_score": chosen_scores.double().sum().cpu(),
            "rejected_score": rejected_scores.double().sum().cpu(),
            "score_gap": gap.double().sum().cpu(),
        }
    return LossOutput(loss_sum=loss_sum, loss_weight=num_pairs, stats=stats)
