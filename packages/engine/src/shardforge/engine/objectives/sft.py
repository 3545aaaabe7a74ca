"""Per-token log-probs from packed logits, and the SFT loss (pure tensor functions).

Legend: T = packed tokens, V = vocab. Log-probs are target-aligned: ``logprobs_T[t]`` is
log p(input_ids[t] | earlier tokens of its sequence), 0 at sequence starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardforge.engine.batching import PackedBatch, sequence_start_mask

__all__ = ["sft_loss", "target_logprobs", "token_count"]


def target_logprobs(logits_TV: torch.Tensor, input_ids_T: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] float32 log-probs of each token given its prefix (0 at sequence starts).

    Uses cross-entropy on the shifted logits, which never materialises a second [T, V]
    log-softmax tensor.
    """
    num_tokens = input_ids_T.numel()
    out = torch.zeros(num_tokens, dtype=torch.float32, device=logits_TV.device)
    if num_tokens > 1:
        nll = F.cross_entropy(logits_TV[:-1].float(), input_ids_T[1:], reduction="none")
        out = torch.cat([out[:1], -nll])
    return out.masked_fill(sequence_start_mask(cu_seqlens, num_tokens), 0.0)


def sft_loss(logprobs_T: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Summed negative log-likelihood over target tokens (the engine divides by the global count)."""
    return -(logprobs_T * batch.loss_mask).sum()


def token_count(batch: PackedBatch) -> torch.Tensor:
    """Loss weight of a micro-batch: its number of target tokens."""
    return batch.loss_mask.sum()
