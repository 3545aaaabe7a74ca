"""HF safetensors export/import without transformers: a plain torch model, sharded on
2 gloo ranks for the streaming paths, and single-process checks of the error cases."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from shardforge.checkpoint_dcp import export_hf, load_hf, write_safetensors_shards
from shardforge.mesh import ParallelDims, build_mesh
from shardforge.mesh.testing import get_rank_pool

VOCAB, DIM, HIDDEN = 16, 10, 7
SHARD_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


class TinyNet(nn.Module):
    """Embedding, two MLP blocks (7x10, 10x7), LayerNorm, head (optionally tied to the
    embedding: one Parameter under two names) and a non-persistent buffer."""

    def __init__(self, *, tie: bool = False, head_name: str = "head", extra: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head_name = head_name
        self.add_module(head_name, nn.Linear(DIM, VOCAB, bias=False))
        if tie:
            getattr(self, head_name).weight = self.embed.weight
        if extra:
            self.extra = nn.Parameter(torch.zeros(3))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        for block in self.blocks:
            h = h + block(h)
        return getattr(self, self.head_name)(self.norm(h))


def build_sharded(seed: int, *, tie: bool) -> nn.Module:
    torch.manual_seed(seed)
    model = TinyNet(tie=tie)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = build_mesh(ParallelDims(dp_shard=dist.get_world_size()), device_type="cpu").get("fsdp")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # embed, norm and the (tied) head belong to the root
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def read_hf_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        part = load_file(str(file))
        assert not tensors.keys() & part.keys(), f"{file.name} repeats tensors"
        tensors.update(part)
    return tensors


def assert_tensors_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


# ---------------------------------------------------------------------------------------------- multi-rank
def _export_and_reload(out: str, max_shard_bytes: int, tie: bool) -> dict[str, Any]:
    model = build_sharded(seed=0, tie=tie)
    params = full_params(model)
    export_hf(model, out, max_shard_bytes=max_shard_bytes)
    bf16_dir = out + "-bf16"
    export_hf(model, bf16_dir, dtype=torch.bfloat16)

    other = build_sharded(seed=1, tie=tie)
    differed = any(not torch.equal(a, b) for a, b in zip(full_params(other).values(), params.values()))
    load_hf(other, out)
    return {
        "params": params,
        "loaded": full_params(other),
        "differed": differed,
        "tied": other.head.weight is other.embed.weight,
        "local_shapes": {n: tuple(p.to_local().shape) for n, p in other.named_parameters()},
    }


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_hf_sharded_and_load_back(tmp_path: Path, tie: bool) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")  # replaced as a whole
    max_shard_bytes = 400
    results = get_rank_pool(2).run(_export_and_reload, str(out), max_shard_bytes, tie)
    params = results[0]["params"]
    names = {n for n, _ in TinyNet(tie=tie).named_parameters()}  # deduplicated: a tied alias once
    assert set(params) == names
    assert ("head.weight" in names) is not tie

    # Files: model-0000k-of-0000n.safetensors + index, and nothing else.
    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert files == sorted([*shards, "model.safetensors.index.json"])
    count = len(shards)
    assert count > 1
    assert [SHARD_NAME.match(f).groups() for f in shards] == [  # type: ignore[union-attr]
        (f"{i:05d}", f"{count:05d}") for i in range(1, count + 1)
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf-bf16"]  # no temp dir left behind

    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == names  # exactly the parameters: no alias, no non-persistent buffer
    assert "scale" not in weight_map
    assert set(weight_map.values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in params.values())
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as handle:
            keys = list(handle.keys())
            assert {k for k, f in weight_map.items() if f == shard} == set(keys)
            size = sum(handle.get_tensor(k).numel() * 4 for k in keys)
            assert size <= max_shard_bytes or len(keys) == 1

    assert_tensors_equal(read_hf_dir(out), params)
    bf16 = read_hf_dir(tmp_path / "hf-bf16")
    assert_tensors_equal(bf16, {k: v.to(torch.bfloat16) for k, v in params.items()})
    assert not (tmp_path / "hf-bf16" / "model.safetensors.index.json").exists()  # one file: no index

    for rank, got in enumerate(results):
        assert got["differed"]
        assert_tensors_equal(got["loaded"], params)
        assert got["tied"] is tie
        # Still sharded after loading: 7 rows split as 4 + 3 over 2 ranks.
        assert got["local_shapes"]["blocks.0.0.weight"] == ((4, DIM) if rank == 0 else (3, DIM))


# ---------------------------------------------------------------------------------------------- one process
def _model(seed: int, **kwargs: Any) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(**kwargs)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def exported(tmp_path: Path) -> tuple[Path, TinyNet]:
    model = _model(0)
    out = tmp_path / "hf"
    export_hf(model, out, max_shard_bytes=500)  # no process group: plain module, one process
    return out, model


def test_export_hf_single_process(exported: tuple[Path, TinyNet]) -> None:
    out, model = exported
    assert_tensors_equal(read_hf_dir(out), _state(model))
    other = _model(1)
    load_hf(other, out)
    assert_tensors_equal(_state(other), _state(model))


def test_load_hf_strict_missing_key(exported: tuple[Path, TinyNet]) -> None:
    out, _ = exported
    model = _model(1, extra=True)
    before = _state(model)
    with pytest.raises(ValueError, match=r"missing \['extra'\] \(1\), unexpected \[\] \(0\)"):
        load_hf(model, out)
    assert_tensors_equal(_state(model), before)  # nothing loaded


def test_load_hf_strict_unexpected_and_renamed(exported: tuple[Path, TinyNet]) -> None:
    out, _ = exported
    model = _model(1, head_name="lm_head")
    with pytest.raises(ValueError) as info:
        load_hf(model, out)
    message = str(info.value)
    assert "missing ['lm_head.weight'] (1)" in message
    assert "unexpected ['head.weight'] (1)" in message
    assert "TinyNet" in message


def test_load_hf_not_strict_loads_the_rest(exported: tuple[Path, TinyNet]) -> None:
    out, source = exported
    model = _model(1, extra=True)
    with torch.no_grad():
        model.extra.fill_(3.0)
    load_hf(model, out, strict=False)
    got = _state(model)
    assert torch.equal(got.pop("extra"), torch.full((3,), 3.0))
    assert_tensors_equal(got, _state(source))


def test_load_hf_tied_alias_in_files_is_not_unexpected(tmp_path: Path) -> None:
    # HF checkpoints of tied models sometimes store the alias too: that is not an error.
    source = _model(0, tie=True)
    tensors = dict(_state(source))  # state_dict has both embed.weight and head.weight
    assert "head.weight" in tensors
    write_safetensors_shards(tensors.items(), tmp_path)
    model = _model(1, tie=True)
    load_hf(model, tmp_path)
    assert torch.equal(model.embed.weight, source.embed.weight)
    assert model.head.weight is model.embed.weight


def test_load_hf_meta_model_raises(exported: tuple[Path, TinyNet]) -> None:
    out, _ = exported
    with torch.device("meta"):
        model = TinyNet()
    with pytest.raises(ValueError, match=r"materialised parameters.*to_empty"):
        load_hf(model, out)


def test_load_hf_without_weights_lists_the_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors\.index\.json nor.*config\.json"):
        load_hf(_model(0), tmp_path)


def test_export_hf_saves_config_and_tokenizer_copies(tmp_path: Path) -> None:
    class FakeConfig:
        def __init__(self) -> None:
            self._attn_implementation = "flex_attention"
            self.hidden_size = DIM

        def save_pretrained(self, directory: str) -> None:
            (Path(directory) / "config.json").write_text(json.dumps(vars(self), default=str))

    class FakeTokenizer:
        def save_pretrained(self, directory: str) -> None:
            (Path(directory) / "tokenizer.json").write_text("{}")

    config = FakeConfig()
    export_hf(_model(0), tmp_path / "hf", config, FakeTokenizer(), dtype=torch.bfloat16)
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["_attn_implementation"] == "sdpa"
    assert saved["hidden_size"] == DIM
    assert "bfloat16" in str(saved["dtype"])
    assert config._attn_implementation == "flex_attention"  # the caller's config is not modified
    assert not hasattr(config, "dtype")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_write_safetensors_shards(tmp_path: Path) -> None:
    tensors = [(f"layer.{i}.weight", torch.full((i + 1, 3), float(i))) for i in range(5)]  # 12..60 bytes
    write_safetensors_shards(iter(tensors), tmp_path, max_shard_bytes=40)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    # Greedy in order: [12+24], [36], [48], [60] (a tensor over the limit gets its own file).
    assert index["weight_map"] == {
        "layer.0.weight": "model-00001-of-00004.safetensors",
        "layer.1.weight": "model-00001-of-00004.safetensors",
        "layer.2.weight": "model-00002-of-00004.safetensors",
        "layer.3.weight": "model-00003-of-00004.safetensors",
        "layer.4.weight": "model-00004-of-00004.safetensors",
    }
    assert index["metadata"]["total_size"] == 12 * (1 + 2 + 3 + 4 + 5)
    assert_tensors_equal(read_hf_dir(tmp_path), dict(tensors))


def test_write_safetensors_single_file(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    write_safetensors_shards(tensors.items(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert_tensors_equal(load_file(str(tmp_path / "model.safetensors")), tensors)
