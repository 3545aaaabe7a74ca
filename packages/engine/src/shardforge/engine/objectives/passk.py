"""Sampled-evaluation metrics: unbiased pass@k (the Codex estimator) and avg@n.

With ``n`` samples of a prompt of which ``c`` are correct, the unbiased estimate of the chance that
at least one of ``k <= n`` samples is correct is (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code", eq. 1)::

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

(the product form avoids huge binomials). avg@n is the mean reward over the n samples (verl's
``mean@n``); pass@1 equals the fraction of correct samples. Both are averaged over prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["pass_at_k", "sampled_eval_sums"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples, ``c`` of them correct (needs 1 <= k <= n)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n samples, got k={k}, n={n}; lower k or raise the sample count")
    if not 0 <= c <= n:
        raise ValueError(f"correct count c={c} must be in [0, n={n}]")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def sampled_eval_sums(
    rewards: Sequence[Sequence[float]], correct: Sequence[Sequence[bool]], ks: Sequence[int]
) -> dict[str, float]:
    """Per-prompt sums (add them over prompts and ranks, then divide by ``num_prompts``).

    ``rewards[p]`` / ``correct[p]``: the n samples of prompt p (the same n for every prompt).
    Keys: ``num_prompts``, ``avg@n``, ``pass@k`` for each k in ``ks``.
    """
    if len(rewards) != len(correct):
        raise ValueError(f"{len(rewards)} reward rows but {len(correct)} correctness rows")
    sizes = {len(r) for r in rewards} | {len(c) for c in correct}
    if len(sizes) > 1:
        raise ValueError(f"every prompt needs the same number of samples, got {sorted(sizes)}")
    n = sizes.pop() if sizes else max(ks, default=1)
    out = {"num_prompts": float(len(rewards)), f"avg@{n}": 0.0} | {f"pass@{k}": 0.0 for k in ks}
    for row_rewards, row_correct in zip(rewards, correct, strict=True):
        out[f"avg@{n}"] += sum(row_rewards) / n
        for k in ks:
            out[f"pass@{k}"] += pass_at_k(n, sum(bool(x) for x in row_correct), k)
    return out
