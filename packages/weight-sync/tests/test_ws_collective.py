"""Collective transport end to end: an FSDP-2 trainer (two gloo ranks) publishes versions
over a standalone gloo group to a receiver in another process; the receiver's weights
must equal the trainer's full state dict (after the dtype cast) bit for bit, per version.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VERSIONS = 3

RECEIVER = textwrap.dedent(
    """
    import sys

    import torch
    from transformers import Qwen3Config, AutoModelForCausalLM

    from shardforge.weight_sync import CollectiveReceiver, WeightReceiver

    port, versions, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(1234)  # initial weights unlike the trainer's
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    worker = CollectiveReceiver(WeightReceiver(model), "127.0.0.1", port, 1, 2, timeout_s=120)
    states = {}
    for _ in range(versions):
        version = worker.receive_version()
        states[version] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(states, out)
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_train_and_publish(port: int) -> list[dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, Qwen3Config

    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.weight_sync import CollectiveTransport, WeightPublisher

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    mesh = build_mesh(ParallelDims(dp_shard=2)).get("fsdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    transport = CollectiveTransport("127.0.0.1", port, 1, timeout_s=120) if dist.get_rank() == 0 else None
    publisher = WeightPublisher(model, transport, bucket_bytes=3000, dtype=torch.bfloat16)
    expected = []
    generator = torch.Generator().manual_seed(dist.get_rank())
    for version in range(1, VERSIONS + 1):
        ids = torch.randint(0, 64, (1, 12), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        publisher.publish(version)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        expected.append({k: v.to(torch.bfloat16) for k, v in full.items()} if dist.get_rank() == 0 else {})
    return expected


def test_collective_publish_reaches_another_process_bit_for_bit(tmp_path: Path) -> None:
    port = _free_port()
    out = tmp_path / "received.pt"
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(VERSIONS), str(out)])
    try:
        expected = get_rank_pool(2).run(rank_train_and_publish, port)[0]
        assert receiver.wait(timeout=180) == 0
    finally:
        if receiver.poll() is None:
            receiver.kill()
    received: dict[int, dict[str, Any]] = torch.load(out)
    assert sorted(received) == list(range(1, VERSIONS + 1))
    for version in range(1, VERSIONS + 1):
        want, got = expected[version - 1], received[version]
        assert set(want) <= set(got)
        mismatched = [k for k in want if not torch.equal(got[k], want[k])]
        assert not mismatched, f"version {version}: {mismatched}"
    # Versions really differ (the optimizer moved the weights between publishes).
    assert not torch.equal(received[1]["lm_head.weight"], received[VERSIONS]["lm_head.weight"])
