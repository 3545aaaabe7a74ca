"""Offline DCP -> HF conversion (`convert_dcp_to_hf` and its CLI), in one process without a
process group. A sharded (FSDP 4) checkpoint is converted in test_ckpt_multirank.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shardforge.checkpoint_dcp import COMMIT_MARKER, Checkpointer, TrainState, convert_dcp_to_hf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VOCAB, DIM, HIDDEN = 16, 10, 7


class TinyNet(nn.Module):
    def __init__(self, *, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def read_hf_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        part = load_file(str(file))
        assert not tensors.keys() & part.keys()
        tensors.update(part)
    return tensors


def assert_tensors_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


def save_trained(root: Path, *, tie: bool = False, extra: dict | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyNet(tie=tie)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    model(torch.arange(8).reshape(2, 4)).square().mean().backward()
    optimizer.step()  # optimizer state in the checkpoint must not leak into the export
    ckpt = Checkpointer(root)
    ckpt.save(3, {"train": TrainState(model, optimizer, step=3), **(extra or {})})
    return ckpt.path(3), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    return save_trained(tmp_path / "ckpts")


def test_convert_matches_model(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, params = checkpoint
    names = convert_dcp_to_hf(path, tmp_path / "hf")
    assert sorted(names) == sorted(params)
    assert "scale" not in names  # non-persistent buffer: not in the checkpoint
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    assert_tensors_equal(read_hf_dir(tmp_path / "hf"), params)


def test_convert_sharded_output_and_dtype(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, params = checkpoint
    out = tmp_path / "hf"
    convert_dcp_to_hf(path, out, max_shard_bytes=300, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(params)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert_tensors_equal(read_hf_dir(out), {k: v.to(torch.bfloat16) for k, v in params.items()})


def test_convert_skip_keys_for_tied_alias(tmp_path: Path) -> None:
    path, params = save_trained(tmp_path / "ckpts", tie=True)
    assert torch.equal(params["head.weight"], params["embed.weight"])
    names = convert_dcp_to_hf(path, tmp_path / "hf", skip_keys=("head.weight",))
    assert "head.weight" not in names
    params.pop("head.weight")
    assert_tensors_equal(read_hf_dir(tmp_path / "hf"), params)


def test_convert_copies_config_files(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, _ = checkpoint
    config_dir = tmp_path / "base"
    config_dir.mkdir()
    (config_dir / "config.json").write_text('{"model_type": "tiny"}')
    (config_dir / "tokenizer_config.json").write_text("{}")
    (config_dir / "model.safetensors").write_bytes(b"old weights: never copied")
    convert_dcp_to_hf(path, tmp_path / "hf", config_dir=config_dir)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "tiny"}
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() != b"old weights: never copied"


def test_convert_refuses_uncommitted(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, _ = checkpoint
    partial = tmp_path / ".tmp-step_00000004"
    shutil.copytree(path, partial)
    os.remove(partial / COMMIT_MARKER)
    with pytest.raises(ValueError, match=f"no {COMMIT_MARKER} marker"):
        convert_dcp_to_hf(partial, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_convert_refuses_non_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"not a DCP checkpoint \(no \.metadata\)"):
        convert_dcp_to_hf(tmp_path / "empty", tmp_path / "hf")


def test_convert_unknown_prefix_lists_top_level_keys(tmp_path: Path) -> None:
    path, _ = save_trained(tmp_path / "ckpts", extra={"ema": {"w": torch.ones(2)}})
    with pytest.raises(ValueError) as info:
        convert_dcp_to_hf(path, tmp_path / "hf", prefix="student.model.")
    message = str(info.value)
    assert "no tensors under 'student.model.'" in message
    assert "top-level keys: ['ema', 'train']" in message
    # Another prefix works: any tensor subtree can be exported.
    assert convert_dcp_to_hf(path, tmp_path / "ema", prefix="ema.") == ["w"]


def test_convert_cli(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, params = checkpoint
    config_dir = tmp_path / "base"
    config_dir.mkdir()
    (config_dir / "config.json").write_text('{"model_type": "tiny"}')
    out = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardforge.checkpoint_dcp.convert",
            str(path),
            str(out),
            "--config",
            str(config_dir),
            "--max-shard-bytes",
            "300",
            "--skip",
            "norm.bias",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {len(params) - 1} tensors to {out}" in proc.stdout
    assert (out / "config.json").is_file()
    assert (out / "model.safetensors.index.json").is_file()
    params.pop("norm.bias")
    assert_tensors_equal(read_hf_dir(out), params)


def test_convert_main_in_process(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardforge.checkpoint_dcp.convert import main

    path, params = checkpoint
    assert main([str(path), str(tmp_path / "hf"), "--prefix", "train.model."]) == 0
    assert f"wrote {len(params)} tensors" in capsys.readouterr().out
    assert_tensors_equal(read_hf_dir(tmp_path / "hf"), params)
    with pytest.raises(FileNotFoundError, match="not a DCP checkpoint"):
        main([str(tmp_path / "missing"), str(tmp_path / "other")])
