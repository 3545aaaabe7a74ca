"""Host-memory placement on CUDA: FSDP2 CPU offload (pinned) and `EngineConfig.offload_when_idle`.

The CPU suite runs the same code with the host as the device (all moves are no-ops); only here do
weights really leave the GPU. Tolerance: offloaded and resident runs do the same arithmetic on the
same device, so losses agree to 1e-5 relative (the optimizer step on the host for FSDP offload runs
the CPU AdamW kernel instead of the CUDA one: 1e-4).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("SHARDFORGE_GPU_TESTS_ON_CPU") == "1"), reason="no CUDA device"
)


CUDA = torch.cuda.is_available()


def _batch(vocab: int = 64):
    from shardforge.engine import pack_sequences

    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 9, 4, 7)]
    return pack_sequences(seqs, [[1.0] * len(s) for s in seqs])


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


def test_offload_when_idle_keeps_weights_and_moments_on_the_host(device) -> None:
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    engine = lambda **kw: TrainEngine(_config(), "d-1", EngineConfig(optimizer=OptimizerConfig(lr=1e-3), **kw))  # noqa: E731
    plain, offloaded = engine(), engine(offload_when_idle=True)
    assert offloaded.offload_state is not None and offloaded.offload_state.active == CUDA
    batch = _batch()
    if CUDA:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
    for _ in range(2):
        a, b = plain.train_batch(batch), offloaded.train_batch(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    torch.testing.assert_close(offloaded.forward(batch), plain.forward(batch))
    if not CUDA:
        pytest.skip("dry run on CPU: the device is the host, nothing to place")
    assert all(p.device.type == "cpu" for p in offloaded.model.parameters())
    moments = [v for s in offloaded.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(m.device.type == "cpu" for m in moments)
    assert all(p.device.type == "cuda" for p in plain.model.parameters())
    # Only the plain engine's weights + moments stay on the GPU after the calls.
    plain_bytes = sum(p.numel() * p.element_size() * 3 for p in plain.model.parameters())
    assert torch.cuda.memory_allocated() - resident <= plain_bytes + (1 << 20)


def test_fsdp2_cpu_offload_pinned_world1(world1, device) -> None:
    """fully_shard over a 1-rank mesh with CPUOffloadPolicy(pin_memory=True): parameters and
    gradients in pinned host memory, compute on the GPU, optimizer step on the host."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from shardforge.fsdp_wrap import FSDPConfig, apply_fsdp, offload_policy

    if CUDA:
        assert offload_policy(True).pin_memory
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(_config())
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
    losses = {}
    for offload in (False, True):
        model = AutoModelForCausalLM.from_config(_config())
        model.load_state_dict(state)
        if not offload:
            model.to(device)
        apply_fsdp(model, mesh, FSDPConfig(cpu_offload=offload))
        if offload and CUDA:
            locals_ = [p.to_local() for p in model.parameters()]
            assert all(t.device.type == "cpu" and t.is_pinned() for t in locals_), "offloaded shards not pinned"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.arange(2, 34, device=device)[None]
        run = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if offload and CUDA:
                assert all(p.grad.to_local().device.type == "cpu" for p in model.parameters())
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[offload] = run
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
