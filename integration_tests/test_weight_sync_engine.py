"""`TrainEngine.publish_weights` under FSDP 2 x TP 2 (world 4): after each of several training
steps the engine publishes over the disk and the collective transport; a receiver in another
process (collective) and a `DiskWeightSource` reader must hold exactly the engine's full state
dict cast to bf16, bit for bit, for every version.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

VERSIONS = 3

RECEIVER = textwrap.dedent(
    """
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from shardforge.weight_sync import CollectiveReceiver, WeightReceiver

    model_dir, port, versions, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    worker = CollectiveReceiver(WeightReceiver(model), "127.0.0.1", port, 1, 2, timeout_s=120)
    states = {}
    for _ in range(versions):
        version = worker.receive_version()
        states[version] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(states, out)
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("ws_engine")
    tiny_assets(root, seed=5, data=False)
    return str(root / "model")


def _free_port() -> int:
    from shardforge.mesh import free_port  # below the ephemeral range: parallel tests cannot take it meanwhile

    return free_port()


def rank_train_and_publish(model_dir: str, layout: str, disk_root: str, port: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.batching import pack_sequences
    from shardforge.weight_sync import CollectiveTransport, DiskTransport

    engine = TrainEngine(model_dir, layout, EngineConfig(max_tokens_per_microbatch=64))
    is_src = dist.get_rank() == 0
    disk = DiskTransport(disk_root) if is_src else None
    collective = CollectiveTransport("127.0.0.1", port, 1, timeout_s=120) if is_src else None
    generator = torch.Generator().manual_seed(dist.get_rank() // engine.dims.tp)
    expected = []
    for _ in range(VERSIONS):
        lengths = torch.randint(4, 12, (3,), generator=generator).tolist()
        seqs = [torch.randint(3, 20, (n,), generator=generator).tolist() for n in lengths]
        engine.train_batch(pack_sequences(seqs))
        for transport in (disk, collective):
            stats = engine.publish_weights(transport, dtype="bf16", bucket_bytes=4096)
            assert (stats is not None) == is_src
        full = engine.full_state_dict()
        expected.append({k: v.to(torch.bfloat16) for k, v in full.items()} if is_src else {})
    return expected


def test_engine_fsdp2_tp2_publishes_bit_for_bit_over_both_transports(model_dir: str, tmp_path: Path) -> None:
    from shardforge.weight_sync import DiskWeightSource

    port = _free_port()
    out = tmp_path / "received.pt"
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, model_dir, str(port), str(VERSIONS), str(out)])
    try:
        expected = get_rank_pool(4).run(rank_train_and_publish, model_dir, "d2t2", str(tmp_path / "disk"), port)[0]
        assert receiver.wait(timeout=180) == 0
    finally:
        if receiver.poll() is None:
            receiver.kill()
    received: dict[int, dict[str, torch.Tensor]] = torch.load(out)
    source = DiskWeightSource(tmp_path / "disk")
    assert sorted(received) == list(range(1, VERSIONS + 1))
    assert source.versions() == [VERSIONS - 1, VERSIONS], "keep_last=2 pruned version 1"
    for version in range(1, VERSIONS + 1):
        want = expected[version - 1]
        got = received[version]
        assert want and set(want) <= set(got)
        mismatched = [k for k in want if not torch.equal(got[k], want[k])]
        assert not mismatched, f"collective version {version}: {mismatched}"
        if version in source.versions():
            on_disk = dict(source.tensors(source.manifest(version)))
            assert on_disk.keys() == want.keys()
            bad = [k for k in want if not torch.equal(on_disk[k], want[k])]
            assert not bad, f"disk version {version}: {bad}"
    assert not torch.equal(received[1]["lm_head.weight"], received[VERSIONS]["lm_head.weight"]), "weights moved"
