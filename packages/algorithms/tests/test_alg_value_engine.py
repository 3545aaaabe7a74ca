"""Value-head `TrainEngine` (critic / reward model): values equal the HF token-classification
forward, the head is built deterministically from an LM checkpoint, export round-trips, pairs stay
in one micro-batch, and a critic step is the same under world 1 and FSDP 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool
from shardforge.mesh.testing.parity import assert_close, assert_counts_match

SEQS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13, 14], [1, 4, 2], [1, 6, 6, 6, 7, 8, 9, 2], [1, 12, 2]]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("value")
    tiny_assets(root, seed=5, data=False)
    return str(root / "model")


def _engine(source: Any, layout: str = "d1", budget: int = 4096, lr: float = 1e-2) -> Any:
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    config = EngineConfig(
        head="value", max_tokens_per_microbatch=budget, seed=3, optimizer=OptimizerConfig(lr=lr, eps=1e-6)
    )
    return TrainEngine(source, layout, config)


def _hf_values(model: Any, seqs: list[list[int]]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([s])).logits[0, :, 0] for s in seqs])


def test_values_match_hf_token_classification_and_export_round_trips(lm_dir: str, tmp_path: Path) -> None:
    from transformers import AutoModelForTokenClassification

    from shardforge.engine import pack_sequences

    batch = pack_sequences(SEQS)
    engine = _engine(lm_dir, budget=12)  # several micro-batches: order and packing must not matter
    values = engine.forward(batch)
    assert values.shape == (batch.num_tokens,)
    # The decoder is the LM checkpoint's, the new head is seeded: a second engine builds the same head.
    assert torch.equal(values, _engine(lm_dir, budget=12).forward(batch))
    # One micro-batch instead of several: the same values up to fp32 rounding.
    torch.testing.assert_close(_engine(lm_dir).forward(batch), values, rtol=0, atol=1e-6)
    assert engine.model.score.bias is None or float(engine.model.score.bias.detach().abs().max()) == 0.0
    engine.export_hf(tmp_path / "vhf")
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "vhf")
    assert hf.config.num_labels == 1 and hf.config.architectures == ["Qwen3ForTokenClassification"]
    # Packed (varlen) attention vs one sequence at a time in HF's own forward: fp32 rounding only.
    torch.testing.assert_close(values, _hf_values(hf, SEQS), rtol=0, atol=1e-5)
    # A value-model directory loads back with its trained head, not a fresh one.
    torch.testing.assert_close(_engine(str(tmp_path / "vhf")).forward(batch), values, rtol=0, atol=1e-6)


def test_value_engine_errors(lm_dir: str) -> None:
    from shardforge.engine import EngineConfig, TrainEngine, pack_sequences
    from shardforge.engine.objectives import PPOActorLossFn

    with pytest.raises(ValueError, match="unknown engine head 'critic'"):
        EngineConfig(head="critic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not support pipeline parallelism"):
        TrainEngine(lm_dir, "p2", EngineConfig(head="value"))
    engine = _engine(lm_dir)
    actor = PPOActorLossFn()
    with pytest.raises(ValueError, match="cannot want entropy"):
        engine.train_batch(pack_sequences(SEQS), actor, actor.loss_weight)


def test_sequence_groups_stay_in_one_microbatch() -> None:
    from shardforge.engine import pack_sequences
    from shardforge.engine.batching import SEQUENCE_GROUP, grouped_microbatches

    batch = pack_sequences(SEQS)  # lengths 5, 7, 3, 8, 3
    batch.extras[SEQUENCE_GROUP] = torch.tensor([0, 0, 1, 1, 2])
    parts = grouped_microbatches(batch, 12)
    assert sorted(i for idx, _ in parts for i in idx) == [0, 1, 2, 3, 4]
    for idx, mb in parts:
        assert mb is not None and mb.num_tokens <= 12
        groups = {int(batch.extras[SEQUENCE_GROUP][i]) for i in idx}
        assert all(set(idx) >= {i for i in range(5) if int(batch.extras[SEQUENCE_GROUP][i]) == g} for g in groups)
    batch.extras[SEQUENCE_GROUP] = torch.tensor([0, 1, 0, 2, 2])
    with pytest.raises(ValueError, match="not contiguous"):
        grouped_microbatches(batch, 12)
    batch.extras[SEQUENCE_GROUP] = torch.tensor([0, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="does not fit one micro-batch"):
        grouped_microbatches(batch, 12)


def _critic_batch(engine: Any) -> Any:
    from shardforge.engine import pack_sequences
    from shardforge.engine.batching import target_aligned_values
    from shardforge.engine.objectives import gae_advantages, token_rewards
    from shardforge.engine.objectives.loss_fns import OLD_VALUES, RETURNS

    masks = [[float(t >= 2) for t in range(len(s))] for s in SEQS]
    batch = pack_sequences(SEQS, masks)
    old = target_aligned_values(engine.forward(batch), batch.cu_seqlens) * batch.loss_mask
    rewards = token_rewards(torch.tensor([1.0, -0.5, 0.3, 2.0, 0.0]), batch.loss_mask, batch.cu_seqlens)
    _, returns = gae_advantages(rewards, old, batch.loss_mask, batch.cu_seqlens, gamma=1.0, lam=0.95)
    batch.extras = {OLD_VALUES: old, RETURNS: returns}
    return batch


def _critic_steps(lm_dir: str, layout: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms.trainers.rl.ppo_update import ShiftedCriticLossFn, dp_reduce_stats
    from shardforge.engine.objectives import PPOCriticConfig, summarize_stats

    engine = _engine(lm_dir, layout, budget=16)
    batch = _critic_batch(engine)
    mine = batch.select(list(range(batch.num_sequences))[engine.dp_rank :: engine.dp_size])
    critic = ShiftedCriticLossFn(PPOCriticConfig(value_clip=0.05))
    history = []
    for _ in range(2):
        stats = engine.train_batch(mine, critic, critic.loss_weight)
        extra = summarize_stats(dp_reduce_stats(critic.pop_stats(), engine))
        history.append({"loss": stats["loss"], "grad_norm": stats["grad_norm"], **extra})
    full = engine.full_state_dict()
    return {"history": history, "weights": full} if not dist.is_initialized() or dist.get_rank() == 0 else {}


def test_critic_step_world1_matches_fsdp2_tp2_cp2(lm_dir: str) -> None:
    single = _critic_steps(lm_dir, "d1")
    # Step 1 starts at old_values (nothing clipped); after it the values moved past +-0.05 for some tokens.
    assert single["history"][0]["value_clip_frac"] == 0 < single["history"][1]["value_clip_frac"]
    # FSDP 2; TP 2 (row-parallel head on sequence-parallel hidden states); CP 2 (values gathered).
    for layout in ("d2", "t2", "c2"):
        sharded = get_rank_pool(2).run(_critic_steps, lm_dir, layout, timeout_s=300)[0]
        for a, b in zip(single["history"], sharded["history"], strict=True):
            # fp32, different reduction order (reduce-scatter, partial matmuls): rounding-level differences only.
            for key in ("loss", "grad_norm", "value_loss", "values"):
                assert_close(a[key], b[key], rel=1e-5, context=(layout, key))
            assert a["num_tokens"] == b["num_tokens"], (layout, a, b)  # from the loss masks: exact
            # A token with |v - v_old| within rounding distance of value_clip may change side
            # (the loss is continuous there): allow 2 boundary tokens. See docs/testing.md.
            assert_counts_match(
                a["value_clip_frac"], b["value_clip_frac"], a["num_tokens"], boundary=2, context=(layout,)
            )
        assert sharded["weights"].keys() == single["weights"].keys() and "score.weight" in single["weights"]
        for key, value in sharded["weights"].items():
            torch.testing.assert_close(value, single["weights"][key], rtol=0, atol=2e-5, msg=f"{layout} {key}")
