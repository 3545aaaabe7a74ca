"""`target_logprobs`, `sft_loss` and `token_count` against naive references."""

from __future__ import annotations

import torch

from shardforge.engine import pack_sequences, sft_loss, target_logprobs, token_count
from shardforge.engine.batching import sequence_start_mask


def _naive_logprobs(logits_TV: torch.Tensor, ids_T: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per sequence: log_softmax of the logits at t-1, gathered at token t; 0 at sequence starts."""
    pieces = []
    start = 0
    for length in lengths:
        logp = torch.log_softmax(logits_TV[start : start + length - 1].float(), dim=-1)
        picked = logp.gather(1, ids_T[start + 1 : start + length, None])[:, 0]
        pieces.append(torch.cat([torch.zeros(1), picked]))
        start += length
    return torch.cat(pieces)


def _random_case(lengths: list[int], vocab: int = 11, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    logits = torch.randn(total, vocab, generator=gen) * 3
    ids = torch.randint(0, vocab, (total,), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return logits, ids, cu


def test_target_logprobs_matches_naive_reference():
    lengths = [4, 1, 3, 5]
    logits, ids, cu = _random_case(lengths)
    got = target_logprobs(logits, ids, cu)
    expected = _naive_logprobs(logits, ids, lengths)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    starts = [0, 4, 5, 8]
    assert got[starts].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert (got[[i for i in range(sum(lengths)) if i not in starts]] < 0).all()


def test_target_logprobs_gradient_matches_naive_reference():
    lengths = [3, 2, 4]
    logits, ids, cu = _random_case(lengths, seed=1)
    weights = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(2))
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    (target_logprobs(a, ids, cu) * weights).sum().backward()
    (_naive_logprobs(b, ids, lengths) * weights).sum().backward()
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    # The last token's logits predict nothing in its sequence, so they get no gradient.
    assert a.grad[[2, 4, 8]].abs().max() == 0


def test_target_logprobs_upcasts_low_precision_logits():
    logits, ids, cu = _random_case([3, 3], seed=3)
    got = target_logprobs(logits.bfloat16(), ids, cu)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _naive_logprobs(logits.bfloat16().float(), ids, [3, 3]))


def test_target_logprobs_single_token_is_zero():
    got = target_logprobs(torch.randn(1, 5), torch.tensor([2]), torch.tensor([0, 1], dtype=torch.int32))
    assert got.tolist() == [0.0]


def test_sequence_start_mask():
    mask = sequence_start_mask(torch.tensor([0, 2, 3, 6], dtype=torch.int32), 6)
    assert mask.tolist() == [True, False, True, True, False, False]


def test_sft_loss_is_masked_negative_sum_and_token_count_sums_the_mask():
    batch = pack_sequences([[1, 2, 3], [4, 5]], [[1, 1, 0], [1, 1]])  # effective mask 0 1 0 0 1
    logprobs = torch.tensor([-9.0, -0.5, -7.0, -8.0, -2.0])
    assert sft_loss(logprobs, batch).item() == 2.5
    assert token_count(batch).item() == 2.0
