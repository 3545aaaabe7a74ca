"""Checkpoint, export and weight publishing from CUDA tensors (world 1, NCCL group).

All exact: DCP save -> load round-trips weights and Adam moments bit for bit; the exported HF
directory and the published weight version hold the engine's tensors bit for bit (fp32 engine,
no casts), and a `WeightReceiver` verifies and applies the published version.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from shardforge.engine import TrainEngine

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("SHARDFORGE_GPU_TESTS_ON_CPU") == "1"), reason="no CUDA device"
)


def _batch(vocab: int):
    from shardforge.engine import pack_sequences

    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in (12, 30, 7)]
    return pack_sequences(seqs, [[1.0] * len(s) for s in seqs])


def _engine(assets) -> TrainEngine:
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    return TrainEngine(assets["model"], "d-1", EngineConfig(optimizer=OptimizerConfig(lr=1e-3)))


def test_dcp_round_trip_from_cuda_is_bit_exact(assets, world1, device, tmp_path) -> None:
    from shardforge.checkpoint_dcp import Checkpointer

    batch = _batch(len(assets["tokenizer"]))
    engine = _engine(assets)
    assert all(p.device == device for p in engine.model.parameters())
    for _ in range(2):
        engine.train_batch(batch)
    ckpt = Checkpointer(tmp_path / "ckpt")
    engine.save(ckpt, {"epoch": 1})
    ckpt.close()
    restored = _engine(assets)
    assert restored.load(Checkpointer(tmp_path / "ckpt")) == {"epoch": 1}
    assert restored.step == engine.step == 2
    for (name, a), b in zip(engine.model.state_dict().items(), restored.model.state_dict().values()):
        assert b.device == device and torch.equal(a, b), name
    for sa, sb in zip(engine.optimizer.state.values(), restored.optimizer.state.values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[key], sb[key].to(sa[key].device)), key
    # Same state, same next step.
    assert restored.train_batch(batch)["loss"] == engine.train_batch(batch)["loss"]


def test_export_hf_from_cuda(assets, world1, device, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    engine = _engine(assets)
    engine.train_batch(_batch(len(assets["tokenizer"])))
    engine.export_hf(tmp_path / "hf", tokenizer=assets["tokenizer"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ours = engine.full_state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, ours[name].cpu()), name


def test_publish_from_cuda_to_disk_and_receive(assets, world1, device, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from shardforge.weight_sync import DiskTransport, DiskWeightSource, WeightReceiver

    engine = _engine(assets)
    engine.train_batch(_batch(len(assets["tokenizer"])))
    stats = engine.publish_weights(DiskTransport(tmp_path / "w"), version=1, bucket_bytes=1 << 16)
    assert stats is not None
    serving = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).to(device)
    receiver = WeightReceiver(serving)
    source = DiskWeightSource(tmp_path / "w")
    assert source.latest() == 1
    manifest = source.manifest(1)
    receiver.apply(manifest, source.tensors(manifest))
    assert receiver.version == 1
    ours = engine.full_state_dict()
    for name, tensor in serving.state_dict().items():
        assert tensor.device == device
        assert torch.equal(tensor.cpu(), ours[name].cpu()), name
