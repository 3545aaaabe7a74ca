"""End to end: a trainer under FSDP 2 (two gloo ranks) publishes consecutive versions to a
`DiskTransport`; a receiver in a separate Python process builds the HF model from the
saved config, applies every version with `DiskWeightSource` + `WeightReceiver`, and saves
its state dicts. They must equal the trainer's full state dict, after the dtype cast,
bit for bit, for every version.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool
from shardforge.weight_sync import DiskWeightSource, Manifest

VERSIONS = 3

RECEIVER = textwrap.dedent(
    """
    import sys

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardforge.weight_sync import DiskWeightSource, WeightReceiver

    config_dir, out = sys.argv[1], sys.argv[2]
    jobs = [(sys.argv[i], sys.argv[i + 1]) for i in range(3, len(sys.argv), 2)]
    config = AutoConfig.from_pretrained(config_dir)
    results = {}
    for root, dtype_name in jobs:
        torch.manual_seed(1234)  # initial weights unlike the trainer's
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
        receiver = WeightReceiver(model)
        source = DiskWeightSource(root)
        states = {}
        for version in source.versions():
            manifest = source.manifest(version)
            receiver.apply(manifest, source.tensors(manifest))
            states[version] = {k: v.clone() for k, v in model.state_dict().items()}
        results[root] = {"versions": source.versions(), "final": receiver.version, "states": states}
    torch.save(results, out)
    print("receiver done", {root: r["versions"] for root, r in results.items()})
    """
)


def rank_train_and_publish(config_dir: str, roots: dict[str, str]) -> dict[str, Any]:
    """Train a few AdamW steps, publishing after each one to every root (one per dtype)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, Qwen3Config

    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.weight_sync import DiskTransport, WeightPublisher

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    rank = dist.get_rank()
    if rank == 0:
        config.save_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # fp32 master weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = build_mesh(ParallelDims(dp_shard=2), device_type="cpu").get("fsdp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    publishers = {
        dtype_name: WeightPublisher(
            model,
            DiskTransport(root, keep_last=VERSIONS) if rank == 0 else None,
            bucket_bytes=8192,
            dtype=getattr(torch, dtype_name),
        )
        for dtype_name, root in roots.items()
    }
    generator = torch.Generator().manual_seed(100 + rank)
    fulls, stats = [], []
    for version in range(1, VERSIONS + 1):
        ids = torch.randint(0, 64, (2, 9), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats.append({name: pub.publish(version) for name, pub in publishers.items()})
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        fulls.append(full)
    return {"fulls": fulls, "stats": stats}


def test_fsdp2_trainer_to_receiver_in_another_process(tmp_path: Path) -> None:
    roots = {"bfloat16": str(tmp_path / "bf16"), "float32": str(tmp_path / "fp32")}
    config_dir = str(tmp_path / "config")
    trainer = get_rank_pool(2).run(rank_train_and_publish, config_dir, roots, timeout_s=180)[0]
    fulls: list[dict[str, torch.Tensor]] = trainer["fulls"]
    assert len(fulls) == VERSIONS
    names = set(fulls[0])
    for earlier, later in itertools.pairwise(fulls):  # the optimizer really moved every weight matrix
        assert all(not torch.equal(earlier[n], later[n]) for n in names if earlier[n].dim() == 2)

    for dtype_name, root in roots.items():
        source = DiskWeightSource(root)
        assert source.versions() == list(range(1, VERSIONS + 1))
        assert not any(p.name.startswith(".tmp-") for p in Path(root).iterdir())
        for version in source.versions():
            manifest = source.manifest(version)
            assert isinstance(manifest, Manifest) and manifest.version == version
            stats = trainer["stats"][version - 1][dtype_name]
            assert stats.version == version and stats.buckets == manifest.num_buckets > 1
            assert stats.max_bucket_bytes <= 8192
            # "lm_head.weight" is tied to the embedding: published once
            assert sorted(manifest.names()) == sorted(names - {"lm_head.weight"})
            assert {t.dtype for t in manifest.tensors} == {f"torch.{dtype_name}"}

    out = tmp_path / "received.pt"
    args = [config_dir, str(out)] + [x for name, root in roots.items() for x in (root, name)]
    proc = subprocess.run(
        [sys.executable, "-c", RECEIVER, *args], capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    received = torch.load(out, weights_only=True)

    for dtype_name, root in roots.items():
        dtype = getattr(torch, dtype_name)
        result = received[root]
        assert result["versions"] == list(range(1, VERSIONS + 1))
        assert result["final"] == VERSIONS
        for version in range(1, VERSIONS + 1):
            state = result["states"][version]
            full = fulls[version - 1]
            assert set(state) == names, "the receiver's state dict covers the trainer's, tied head included"
            for name in sorted(names):
                expected = full[name].to(dtype)
                assert state[name].dtype == dtype, (dtype_name, version, name)
                assert torch.equal(state[name], expected), (dtype_name, version, name)
