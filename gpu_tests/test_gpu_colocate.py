"""Colocated placement on CUDA (trainers/rl_colocate.py): the device memory that `TrainEngine.offloaded` and
`HFRolloutEngine.sleep` hand over really leaves the GPU, and comes back bit-identical (trainer) or as exactly
the published version (rollout engine). The CPU suite (packages/algorithms/tests/test_alg_colocate.py) checks the
runs and the order of the phases; there the device is the host and the moves are no-ops.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("SHARDFORGE_GPU_TESTS_ON_CPU") == "1"), reason="no CUDA device"
)

CUDA = torch.cuda.is_available()


def _allocated() -> int:
    if not CUDA:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


def _batch():
    from shardforge.engine import pack_sequences

    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (6, 9, 4, 7)]
    return pack_sequences(seqs, [[1.0] * len(s) for s in seqs])


def test_offloaded_frees_weights_and_moments_and_restores_them_bit_identically(device) -> None:
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    engine = TrainEngine(_config(), "d-1", EngineConfig(optimizer=OptimizerConfig(lr=1e-3)))
    plain = TrainEngine(_config(), "d-1", EngineConfig(optimizer=OptimizerConfig(lr=1e-3)))
    batch = _batch()
    engine.train_batch(batch), plain.train_batch(batch)  # Adam moments exist now
    weights = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    moments = [v.clone() for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
    held = sum(p.numel() * p.element_size() for p in engine.model.parameters()) + sum(
        m.numel() * m.element_size() for m in moments
    )
    before = _allocated()
    with engine.offloaded():
        inside = _allocated()
        if CUDA:
            assert all(p.device.type == "cpu" for p in engine.model.parameters())
            assert before - inside >= held, f"only {before - inside} of {held} bytes left the GPU"
    assert abs(_allocated() - before) <= 1 << 20  # allocator rounding
    after = engine.model.state_dict()
    assert all(torch.equal(after[k], w) for k, w in weights.items())
    now = [v for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert all(torch.equal(a, b) and a.device == device for a, b in zip(now, moments, strict=True))
    a, b = engine.train_batch(batch), plain.train_batch(batch)
    # Two engines, same arithmetic; 1e-6 leaves room for a nondeterministic CUDA reduction (the round trip
    # itself is checked bit for bit above).
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


def test_sleeping_rollout_engine_frees_its_weights_and_wakes_with_the_published_version(device, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from shardforge.algorithms.testing import tiny_assets
    from shardforge.rollout import HFRolloutEngine, SamplingParams
    from shardforge.weight_sync import DiskTransport, WeightPublisher

    assets = tiny_assets(tmp_path / "assets", seed=3, hidden=64, data=False)
    root = tmp_path / "weights"
    engine = HFRolloutEngine(assets["model"], assets["tokenizer"], weights_root=root, device=device)
    control = HFRolloutEngine(assets["model"], assets["tokenizer"], weights_root=root, device=device)
    before = _allocated()
    freed = engine.sleep()
    if CUDA:
        assert before - _allocated() >= freed > 0
    trainer = AutoModelForCausalLM.from_pretrained(assets["model"])
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(0.9)
    WeightPublisher(trainer, DiskTransport(root)).publish(1)
    engine.update_weights(1), control.update_weights(1)
    assert abs(_allocated() - before) <= 1 << 20  # allocator rounding
    prompts = [assets["tokenizer"].encode("12+3=")]
    params = SamplingParams(max_new_tokens=4, temperature=0.9, seed=1, n=2)
    got, want = engine.generate(prompts, params), control.generate(prompts, params)
    assert [(r.response_ids, r.logprobs) for r in got] == [(r.response_ids, r.logprobs) for r in want]
