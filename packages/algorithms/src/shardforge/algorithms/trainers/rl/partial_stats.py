"""Per-token staleness of a partial-rollout batch: local counts (kept with the batch, checkpointed with it)
and the metrics made from counts summed over data-parallel ranks, so ``partial/*`` describe the whole
step's batch, not one rank's share (the trainer reduces: `trainers.rl_partial.partial_rollout_stats`)."""

from __future__ import annotations

from typing import Any

from shardforge.rollout.episodes.trajectory import Trajectory

__all__ = ["STALENESS_COUNTS", "staleness_metrics", "token_staleness_counts"]

STALENESS_COUNTS = ("lag_sum", "tokens", "fresher_tokens", "interrupted", "sequences")
"""The additive counts (summed over ranks); ``lag_max`` (the oldest token's lag) is reduced by max."""


def token_staleness_counts(rollouts: list[Any], index: int, policy_steps: dict[int, int]) -> dict[str, float]:
    """This rank's counts for batch ``index`` (``policy_steps``: weight version -> policy step): the summed lag
    of its generated tokens (``index`` - the policy step that made the token), the tokens, the tokens made by
    newer weights than their sequence's first token, the sequences continued under newer weights, the
    sequences, and the largest lag. Always every key (zeros for no tokens): every rank joins the reduction."""
    counts = dict.fromkeys((*STALENESS_COUNTS, "lag_max"), 0.0)
    counts["sequences"] = float(len(rollouts))
    for r in rollouts:
        if isinstance(r, Trajectory):
            versions = [v for v, m in zip(r.versions, r.loss_mask, strict=True) if m]
        else:
            versions = r.versions
        if not versions:
            continue
        lags = [index - policy_steps[v] for v in versions]
        counts["lag_sum"] += sum(lags)
        counts["tokens"] += len(lags)
        counts["lag_max"] = max(counts["lag_max"], float(max(lags)))
        counts["fresher_tokens"] += sum(v != versions[0] for v in versions)
        counts["interrupted"] += len(set(versions)) > 1
    return counts


def staleness_metrics(counts: dict[str, float]) -> dict[str, float]:
    """``partial/*`` from (reduced) counts: the mean and oldest token's staleness (what the limit bounds), the
    share of tokens made by newer weights than their sequence's first token, and the share of sequences that
    were interrupted and continued. Empty when there are no generated tokens."""
    if not counts.get("tokens"):
        return {}
    return {
        "partial/token_staleness_mean": counts["lag_sum"] / counts["tokens"],
        "partial/token_staleness_max": counts["lag_max"],
        "partial/fresher_token_frac": counts["fresher_tokens"] / counts["tokens"],
        "partial/interrupted_frac": counts["interrupted"] / max(counts["sequences"], 1.0),
    }
