"""Collective transport end to end: an FSDP-2 trainer (two gloo ranks) publishes versions
over a standalone gloo group to a receiver in another process; the receiver's weights
must equal the trainer's full state dict (after the dtype cast) bit for bit, per version.
"""

from __future__ import annotations

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
    from shardforge.mesh import free_port  # below the ephemeral range: parallel tests cannot take it meanwhile

    return free_port()


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


# ----------------------------------------------------------------------------- a crash

FAULT_RECEIVER = textwrap.dedent(
    """
    import sys

    import torch
    from torch import nn

    from shardforge.weight_sync import CollectiveReceiver, WeightReceiver

    port, out = int(sys.argv[1]), sys.argv[2]
    torch.manual_seed(99)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(6)])
    worker = CollectiveReceiver(WeightReceiver(model), "127.0.0.1", port, 1, 2, timeout_s=60)
    snap = lambda: {k: v.clone() for k, v in model.state_dict().items()}
    log = {"v1": worker.receive_version(), "after_v1": snap()}
    try:
        worker.receive_version()  # the sender dies part-way through version 2
        log["v2_error"] = None
    except Exception as exc:
        log["v2_error"] = repr(exc)
    log["serving_after_crash"] = worker.receiver.version
    log["after_crash"] = snap()
    log["v3"] = worker.receive_version()  # reconnects to the restarted sender's new session
    log["after_v3"] = snap()
    torch.save(log, out)
    """
)

FAULT_SENDER = textwrap.dedent(
    """
    import os
    import sys

    import torch
    from torch import nn

    from shardforge.weight_sync import CollectiveTransport, WeightPublisher

    port, seed, die_at = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
    versions, out = [int(v) for v in sys.argv[3].split(",")], sys.argv[5]

    class Dies(CollectiveTransport):
        sent = 0

        def send(self, bucket):
            self.sent += 1
            if self.sent == die_at:
                os._exit(17)  # killed mid-version: no ABORT message, no cleanup
            super().send(bucket)

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(6)])
    transport = Dies("127.0.0.1", port, 1, timeout_s=60)
    publisher = WeightPublisher(model, transport, bucket_bytes=256)  # one 8x8 fp32 tensor per bucket
    torch.save(model.state_dict(), out)  # the first version's weights
    for version in versions:
        publisher.publish(version)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)
    """
)


def test_sender_killed_mid_version_receiver_keeps_previous_then_recovers(tmp_path: Path) -> None:
    """Fault: the sender process dies after 2 of 6 buckets of version 2. The receiver reports
    the error, keeps serving version 1 bit for bit, then applies version 3 from a restarted
    sender (a new session on the same address)."""
    port = _free_port()
    out = tmp_path / "receiver.pt"
    receiver = subprocess.Popen([sys.executable, "-c", FAULT_RECEIVER, str(port), str(out)])
    try:
        first = subprocess.run(
            [sys.executable, "-c", FAULT_SENDER, str(port), "0", "1,2", "9", str(tmp_path / "a.pt")],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert first.returncode == 17, first.stdout + first.stderr
        v1 = torch.load(tmp_path / "a.pt", weights_only=True)
        second = subprocess.run(
            [sys.executable, "-c", FAULT_SENDER, str(port), "7", "3", "0", str(tmp_path / "b.pt")],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert second.returncode == 0, second.stdout + second.stderr
        assert receiver.wait(timeout=120) == 0
    finally:
        if receiver.poll() is None:
            receiver.kill()
    log = torch.load(out, weights_only=True)
    v3 = torch.load(tmp_path / "b.pt", weights_only=True)
    assert log["v1"] == 1 and log["v2_error"] is not None, log["v2_error"]
    assert log["serving_after_crash"] == 1
    assert all(torch.equal(log["after_v1"][k], v1[k]) for k in v1), "version 1 arrived bit for bit"
    assert all(torch.equal(log["after_crash"][k], v1[k]) for k in v1), "still serving version 1"
    assert log["v3"] == 3
    assert all(torch.equal(log["after_v3"][k], v3[k]) for k in v3), "version 3 arrived bit for bit"


def test_refused_version_keeps_the_connection_and_the_previous_weights() -> None:
    """A version whose checksum does not verify is refused after it fully arrived; the receiver
    keeps serving the previous version on the same connection and takes the next one.
    Sender and receiver run as two threads of this process (two standalone gloo groups)."""
    import dataclasses
    import threading

    from torch import nn

    from shardforge.weight_sync import (
        CollectiveReceiver,
        CollectiveTransport,
        WeightPublisher,
        WeightReceiver,
        WeightVersionError,
    )

    class Corrupting(CollectiveTransport):
        def commit(self, manifest: Any) -> None:
            if manifest.version == 2:  # claim a wrong checksum for the first tensor
                bad = dataclasses.replace(manifest.tensors[0], checksum="crc32:00000000")
                manifest = dataclasses.replace(manifest, tensors=[bad, *manifest.tensors[1:]])
            super().commit(manifest)

    torch.manual_seed(0)
    trainer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    serving = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    transport = Corrupting("127.0.0.1", 0, 1, timeout_s=60)
    outcomes: list[Any] = []

    def receive() -> None:
        worker = CollectiveReceiver(WeightReceiver(serving), "127.0.0.1", transport.port, 1, 2, timeout_s=60)
        for _ in range(3):
            try:
                outcomes.append(worker.receive_version())
            except WeightVersionError as exc:
                outcomes.append(exc)
            outcomes.append({k: v.clone() for k, v in serving.state_dict().items()})

    thread = threading.Thread(target=receive)
    thread.start()
    publisher = WeightPublisher(trainer, transport, bucket_bytes=64)
    sent = []
    for version in (1, 2, 3):
        sent.append({k: v.clone() for k, v in trainer.state_dict().items()})
        publisher.publish(version)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1.0)
    thread.join(timeout=60)
    transport.close()
    assert not thread.is_alive()
    v1, refused, v3 = outcomes[0], outcomes[2], outcomes[4]
    assert v1 == 1 and v3 == 3
    assert isinstance(refused, WeightVersionError) and "checksum mismatch" in str(refused)
    assert all(torch.equal(outcomes[1][k], sent[0][k]) for k in sent[0])
    assert all(torch.equal(outcomes[3][k], sent[0][k]) for k in sent[0]), "still serving version 1"
    assert all(torch.equal(outcomes[5][k], sent[2][k]) for k in sent[2])
