"""Per-row seeded sampling for the embedded HF engine: each row draws from its own stream of uniforms.

Row (prompt ``i``, sample ``j``) of a ``generate`` call gets ``max_new_tokens`` float64 uniforms from a CPU
generator seeded ``seeds[i] + j`` (`rollout.seeds`); `RowSampler`, a logits processor, turns the uniform of
each step into the row's token by inverting the CDF of its tempered softmax. A row's tokens therefore depend on
its logits and its seed alone: not on the other rows of the batch, ``batch_size``, partial-rollout chunks (the
uniforms are indexed by the step of the response), or whether the row's prompt was prefilled from a reused KV
cache (`rollout.kv_reuse`: the step index counts the cached columns too).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from shardforge.rollout.seeds import SEED_LIMIT, prompt_seeds
from shardforge.rollout.types import SamplingParams

__all__ = ["RowSampler", "row_uniforms"]


def row_uniforms(params: SamplingParams, num_prompts: int) -> torch.Tensor:
    """[rows, max_new_tokens] float64 uniforms: row (prompt i, sample j) from a generator seeded ``seeds[i] + j``
    (unseeded: seeds drawn from the global torch generator, so ``torch.manual_seed`` still fixes them). Drawn on
    the CPU, one short call per row: the same numbers on every device and machine."""
    seeds = prompt_seeds(params, num_prompts)
    if seeds is None:
        seeds = torch.randint(0, SEED_LIMIT - params.n, (num_prompts,)).tolist()
    generator = torch.Generator()
    draws = []
    for seed in seeds:
        for j in range(params.n):
            generator.manual_seed(seed + j)
            draws.append(torch.rand(params.max_new_tokens, generator=generator, dtype=torch.float64))
    return torch.stack(draws)


class RowSampler(LogitsProcessor):
    """Samples each row's next token by inverting the CDF of its own softmax(scores / temperature) (top-k, top-p as
    HF's warpers) at the row's uniform for this position, and leaves only that token finite (greedy search picks it).
    A row's sample depends on its logits and its uniform alone, never on the batch's other rows."""

    def __init__(self, uniforms: torch.Tensor, width: int, params: SamplingParams) -> None:
        self.uniforms, self.width, self.temperature = uniforms, width, params.temperature
        self.top_k = TopKLogitsWarper(params.top_k) if params.top_k > 0 else None
        self.top_p = TopPLogitsWarper(params.top_p) if params.top_p < 1 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scaled = scores.float() / self.temperature
        if self.top_k is not None:
            scaled = self.top_k(input_ids, scaled)
        if self.top_p is not None:
            scaled = self.top_p(input_ids, scaled)
        cdf = torch.softmax(scaled, dim=-1).double().cumsum(dim=-1)
        u = self.uniforms[:, input_ids.shape[1] - self.width, None] * cdf[:, -1:]
        # The first token whose CDF exceeds u (right=True: a zero-probability token is never picked).
        token = torch.searchsorted(cdf, u, right=True).clamp_(max=scores.shape[-1] - 1)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, token, 0.0)  # type: ignore[return-value]
