"""`EngineConfig.offload_when_idle`: weights and optimizer state on the host between engine calls.

On CPU the device is the host, so the moves are no-ops: the CPU tests check that the decorated
paths (nested export, forward, train) give the same numbers as a plain engine. The placement test
runs only where CUDA is present (the same file, selected by the device).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences
from shardforge.engine.features.offload import move_optimizer_state

VOCAB = 64


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def engine(**kwargs) -> TrainEngine:
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return TrainEngine(cfg, "d-1", EngineConfig(optimizer=OptimizerConfig(lr=1e-3), **kwargs))


def _batch():
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 9, 4, 7)]
    return pack_sequences(seqs, [[1.0] * len(s) for s in seqs])


def test_offload_when_idle_and_cpu_offload_are_exclusive() -> None:
    with pytest.raises(ValueError, match="exclusive"):
        EngineConfig(offload_when_idle=True, cpu_offload=True)


def test_offloaded_engine_trains_like_a_plain_one(tmp_path) -> None:
    plain, offloaded = engine(), engine(offload_when_idle=True)
    assert offloaded.offload_state is not None and plain.offload_state is None
    batch = _batch()
    for _ in range(3):
        a, b = plain.train_batch(batch), offloaded.train_batch(batch)
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    torch.testing.assert_close(offloaded.forward(batch), plain.forward(batch), rtol=0, atol=0)
    # export_hf -> full_state_dict nest two decorated calls: the model must stay usable after.
    offloaded.export_hf(tmp_path / "hf")
    assert offloaded.eval_batch(batch)["loss"] == plain.eval_batch(batch)["loss"]
    if offloaded.device.type == "cpu":
        assert not offloaded.offload_state.active and not offloaded.offload_state.offloaded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="placement needs a device separate from the host")
def test_weights_and_moments_live_on_the_host_between_calls() -> None:
    plain, offloaded = engine(), engine(offload_when_idle=True)
    batch = _batch()
    for _ in range(2):
        a, b = plain.train_batch(batch), offloaded.train_batch(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert all(p.device.type == "cpu" for p in offloaded.model.parameters())
    moments = [v for s in offloaded.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(m.device.type == "cpu" for m in moments)
    torch.testing.assert_close(offloaded.forward(batch), plain.forward(batch))
    assert all(p.device.type == "cpu" for p in offloaded.model.parameters())


def test_move_optimizer_state_moves_moments_not_steps() -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    # Same device: nothing to move, nothing counted.
    assert move_optimizer_state(opt, "cpu") == 0
    if torch.cuda.is_available():
        moved = move_optimizer_state(opt, "cuda")
        assert moved == 2 * sum(p.numel() * 4 for p in model.parameters())
        assert all(s["step"].device.type == "cpu" for s in opt.state.values())
