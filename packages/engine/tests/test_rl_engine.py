"""`PPOActorLossFn` through a real `TrainEngine` (one process): the aggregation contract holds end to end."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences
from shardforge.engine.objectives import (
    PPOActorConfig,
    PPOActorLossFn,
    broadcast_to_tokens,
    grpo_advantages,
    ppo_actor_loss,
    summarize_stats,
)
from shardforge.mesh.testing.parity import assert_counts_match

VOCAB = 64
LENGTHS = [3, 12, 5, 10, 4, 7]  # budget 16 -> several micro-batches, sequence order changes


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _engine(budget: int) -> TrainEngine:
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    config = EngineConfig(optimizer=OptimizerConfig(lr=1e-3), max_tokens_per_microbatch=budget)
    return TrainEngine(cfg, "d-1", config)


def _rollout_batch(engine: TrainEngine):
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    masks = [[float(t >= 2) for t in range(n)] for n in LENGTHS]  # a 2-token "prompt", then the response
    masks[3] = [0.0] * LENGTHS[3]  # an all-masked row (e.g. a truncated response)
    batch = pack_sequences(seqs, masks)
    current = engine.forward(batch)
    # behaviour log-probs from a slightly different sampler (token noise plus a per-sequence shift),
    # so token and sequence ratios both leave the trust region for some tokens
    shift = torch.tensor([-0.3, 0.3, 0.05, 0.2, 0.25, 0.0]).repeat_interleave(torch.tensor(LENGTHS))
    old = current + 0.3 * torch.randn(batch.num_tokens, generator=gen) + shift
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    batch.extras = {
        "old_logprobs": old,
        "advantages": broadcast_to_tokens(grpo_advantages(rewards, 3), batch.loss_mask, batch.cu_seqlens),
    }
    return batch, current


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_ppo_step_is_independent_of_micro_batching_and_matches_the_pure_loss(mode: str) -> None:
    cfg = PPOActorConfig(
        aggregation=mode,
        norm_length=16.0,
        ratio_level="sequence" if "seq" in mode else "token",
        clip_eps_low=0.1,
        dual_clip=3.0,
    )
    small, big = _engine(16), _engine(4096)
    batch, current = _rollout_batch(big)
    expected = ppo_actor_loss(
        current,
        old_logprobs=batch.extras["old_logprobs"],
        advantages=batch.extras["advantages"],
        loss_mask=batch.loss_mask,
        cu_seqlens=batch.cu_seqlens,
        config=cfg,
    )
    fn_small, fn_big = PPOActorLossFn(cfg), PPOActorLossFn(cfg)
    s_small = small.train_batch(batch, fn_small, fn_small.loss_weight)
    s_big = big.train_batch(batch, fn_big, fn_big.loss_weight)
    assert s_small["microbatches"] > 1 and s_big["microbatches"] == 1
    assert s_big["loss"] == pytest.approx(float(expected.loss.detach()), rel=1e-5)
    assert s_small["loss"] == pytest.approx(s_big["loss"], rel=1e-5)
    assert s_small["loss_weight"] == s_big["loss_weight"] == float(expected.loss_weight)
    assert s_small["grad_norm"] == pytest.approx(s_big["grad_norm"], rel=1e-4) and s_big["grad_norm"] > 0
    for name, p_big in big.model.named_parameters():
        # Adam's first step turns float32 summation-order differences into <= ~1e-5 (see test_alg_engine)
        torch.testing.assert_close(small.model.get_parameter(name).detach(), p_big.detach(), rtol=0, atol=1e-5)
    stats_small, stats_big = summarize_stats(fn_small.pop_stats()), summarize_stats(fn_big.pop_stats())
    assert 0 < stats_big["clip_frac"] < 1
    assert stats_small["num_tokens"] == stats_big["num_tokens"]  # from the loss mask: exact
    for key in ("approx_kl", "ratio", "pg_loss", "loss"):
        assert stats_small[key] == pytest.approx(stats_big[key], rel=1e-5, abs=1e-7), key
    # Clip fractions count tokens past ratio = 1 +- eps; the two micro-batchings compute the
    # log-probs with different matmul shapes, so a token at the threshold may change side: allow
    # one boundary token (the continuous statistics above must agree). See docs/testing.md.
    for key in ("clip_frac", "dual_clip_frac"):
        assert_counts_match(stats_small[key], stats_big[key], stats_big["num_tokens"], boundary=1, context=(key,))


def test_token_sum_is_the_unnormalised_sum_whatever_the_micro_batching() -> None:
    """``token-sum``: loss and gradient are token-mean's times the batch's target-token count (W fixed at 1),
    with one micro-batch or several."""
    mean_cfg = PPOActorConfig(aggregation="token-mean", clip_eps_low=0.1)
    sum_cfg = PPOActorConfig(aggregation="token-sum", clip_eps_low=0.1)
    results = {}
    for name, cfg, budget in (("mean", mean_cfg, 4096), ("sum", sum_cfg, 4096), ("sum_small", sum_cfg, 16)):
        engine = _engine(budget)
        batch, _ = _rollout_batch(engine)
        fn = PPOActorLossFn(cfg)
        results[name] = (engine.train_batch(batch, fn, fn.loss_weight), summarize_stats(fn.pop_stats()))
    tokens = float((batch.loss_mask != 0).sum())
    mean, total, small = results["mean"][0], results["sum"][0], results["sum_small"][0]
    assert small["microbatches"] > 1 and total["loss_weight"] == small["loss_weight"] == 1.0
    assert total["loss"] == pytest.approx(mean["loss"] * tokens, rel=1e-5)
    assert total["grad_norm"] == pytest.approx(mean["grad_norm"] * tokens, rel=1e-4)
    assert small["loss"] == pytest.approx(total["loss"], rel=1e-5)
    assert small["grad_norm"] == pytest.approx(total["grad_norm"], rel=1e-4)
    assert "loss" not in results["sum"][1] and results["sum"][1]["loss_sum"] == pytest.approx(total["loss"], rel=1e-5)
