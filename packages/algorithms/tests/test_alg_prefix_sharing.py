"""Shared prompt prefixes (`batching.prefix_sharing`, ``EngineConfig.share_prefixes``): the engine holds a
group's prompt once per micro-batch and every output, loss and gradient is the unshared one."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences
from shardforge.engine.batching import share_prefixes, unshare_outputs
from shardforge.engine.objectives import PPOActorConfig, PPOActorLossFn, broadcast_to_tokens, grpo_advantages

VOCAB = 48
PROMPTS = [[1, 5, 9, 11, 7, 3, 8, 2, 6], [1, 4, 4, 10, 12, 13]]  # 9- and 6-token prompts
RESPONSES = [[20, 21, 22], [23, 24], [20, 30, 31, 32], [25], [40, 41], [40, 42, 43], [44], [45, 46, 47]]
GROUP = 4


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _group_batch():
    """Two prompts x 4 samples: each sample = its prompt + a response (targets: the response only)."""
    seqs = [PROMPTS[i // GROUP] + r for i, r in enumerate(RESPONSES)]
    masks = [[0.0] * len(PROMPTS[i // GROUP]) + [1.0] * len(r) for i, r in enumerate(RESPONSES)]
    return pack_sequences(seqs, masks)


def test_share_prefixes_keeps_each_prompt_once_with_positions_and_maps_outputs_back() -> None:
    batch = _group_batch()
    batch.extras = {"per_token": torch.arange(batch.num_tokens, dtype=torch.float32), "per_seq": torch.arange(8.0)}
    shared = share_prefixes(batch)
    # a dependent keeps its prompt's last token (its output predicts the first response token)
    expected_lengths = [len(PROMPTS[0]) + 3, 3, 5, 2, len(PROMPTS[1]) + 2, 4, 2, 4]
    assert shared.seq_lens == expected_lengths
    assert shared.num_tokens == batch.num_tokens - 3 * (9 - 1) - 3 * (6 - 1)
    assert shared.prefixes is not None and shared.unshared_index is not None
    source1 = sum(expected_lengths[:4])
    assert shared.prefixes.tolist() == [
        [0, 0],
        [0, 8],
        [0, 8],
        [0, 8],
        [0, 0],
        [source1, 5],
        [source1, 5],
        [source1, 5],
    ]
    # positions continue after the prefix: the second sample's kept tokens sit at 8, 9, 10
    assert shared.position_ids[12:15].tolist() == [8, 9, 10]
    assert shared.input_ids[12:15].tolist() == [6, 23, 24]  # the prompt's last token, then the response
    assert torch.equal(shared.extras["per_seq"], batch.extras["per_seq"])
    kept = shared.extras["per_token"].long()  # per-token extras follow the kept tokens
    assert kept[12:15].tolist() == [20, 21, 22]  # sample 2 starts at token 12 and keeps 12 + 8 ..
    # a kept token maps to itself, except a dependent's first (the prompt's last: the source's has its output)
    expected = torch.arange(shared.num_tokens)
    expected[[12, 15, 20]], expected[[source1 + 8, source1 + 12, source1 + 14]] = 8, source1 + 5
    assert torch.equal(shared.unshared_index[kept], expected)
    assert torch.equal(shared.loss_mask.sum(), batch.loss_mask.sum())
    # every original token maps to a shared token with the same id and position (the same context)
    back = shared.unshared_index
    assert torch.equal(shared.input_ids[back], batch.input_ids)
    assert torch.equal(shared.position_ids[back], batch.position_ids)
    assert torch.equal(unshare_outputs(shared.input_ids, shared), batch.input_ids)


def test_share_prefixes_never_drops_a_target_and_respects_the_minimum() -> None:
    batch = pack_sequences(
        [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 9]], [[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]]
    )
    assert share_prefixes(batch, min_shared=1).seq_lens == [7, 5]  # only the 3 non-target tokens: 2 dropped
    assert share_prefixes(batch, min_shared=3) is batch  # 2 < 3: nothing shared
    different = pack_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 5, 6]], [[0] * 5 + [1], [0] * 5 + [1]])
    assert share_prefixes(different, min_shared=1).seq_lens == [6, 4]  # shares up to the first difference


def _engine(share: bool | None, head: str = "lm", budget: int = 4096) -> TrainEngine:
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    # eps=1: the update is ~lr x gradient (Adam's g/|g| would turn float noise in near-zero gradients into +-lr)
    config = EngineConfig(
        optimizer=OptimizerConfig(lr=1.0, eps=1.0), max_tokens_per_microbatch=budget, share_prefixes=share, head=head
    )
    return TrainEngine(cfg, "d-1", config)


def test_engine_outputs_loss_and_update_equal_the_unshared_ones() -> None:
    plain, shared = _engine(False), _engine(None)  # None: auto, on for a dense model on CPU
    batch = _group_batch()
    [(_, mb)] = shared.runner.microbatches(batch).items  # type: ignore[attr-defined]
    assert mb is not None and mb.num_tokens < batch.num_tokens  # sharing really happened
    [(_, unshared_mb)] = plain.runner.microbatches(batch).items  # type: ignore[attr-defined]
    assert unshared_mb is not None and unshared_mb.num_tokens == batch.num_tokens
    before = plain.forward(batch)
    torch.testing.assert_close(shared.forward(batch), before, atol=1e-5, rtol=1e-5)  # every position
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2])
    batch.extras = {
        "old_logprobs": before + 0.05,
        "advantages": broadcast_to_tokens(grpo_advantages(rewards, GROUP), batch.loss_mask, batch.cu_seqlens),
    }
    for mode in ("token-mean", "seq-mean-token-mean"):
        actor = PPOActorLossFn(PPOActorConfig(aggregation=mode, clip_eps_low=0.1))
        a = plain.train_batch(batch, actor, actor.loss_weight)
        b = shared.train_batch(batch, actor, actor.loss_weight)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["tokens"] == b["tokens"]
    for (name, p), (_, q) in zip(plain.model.named_parameters(), shared.model.named_parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
    after = shared.forward(batch)
    assert (after - before).abs().max() > 1e-3  # the updates moved the model
    torch.testing.assert_close(after, plain.forward(batch), atol=1e-5, rtol=1e-5)


def test_value_head_and_micro_batches_share_within_each_micro_batch() -> None:
    plain, shared = _engine(False, head="value", budget=40), _engine(None, head="value", budget=40)
    batch = _group_batch()
    items = shared.runner.microbatches(batch).items  # type: ignore[attr-defined]
    assert len(items) > 1 and sum(mb.num_tokens for _, mb in items if mb is not None) < batch.num_tokens
    torch.testing.assert_close(shared.forward(batch), plain.forward(batch), atol=1e-5, rtol=1e-5)


def test_share_prefixes_true_is_refused_where_unsupported() -> None:
    from types import SimpleNamespace

    from shardforge.engine.features.prefix_sharing import prefix_sharing_blockers, use_prefix_sharing
    from shardforge.engine.heads import LMHead

    dims = SimpleNamespace(cp=2, pp=1)
    ctx = SimpleNamespace(dims=dims, config=EngineConfig(share_prefixes=True), device=torch.device("cpu"))
    sliding = SimpleNamespace(layer_types=["sliding_attention", "full_attention"])
    assert len(prefix_sharing_blockers(ctx, LMHead(), sliding, moe=True)) == 3  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"share_prefixes=true is not supported with context parallelism \(cp=2\)"):
        use_prefix_sharing(ctx, LMHead(), SimpleNamespace(), moe=False)  # type: ignore[arg-type]
    dims.cp = 1
    auto = SimpleNamespace(dims=dims, config=EngineConfig(), device=torch.device("cpu"))
    assert use_prefix_sharing(auto, LMHead(), SimpleNamespace(), moe=False)  # type: ignore[arg-type]
    assert not use_prefix_sharing(auto, LMHead(), SimpleNamespace(), moe=True)  # type: ignore[arg-type]
