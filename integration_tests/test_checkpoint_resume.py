"""Checkpoint/resume through the real SFT trainer: bit-identical resume after the ranks are
killed, resume under a different layout, HF export loaded by plain transformers in a fresh
process, and the offline DCP -> HF converter."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("ckpt_assets")
    _tiny = tiny_assets(root, seed=7, max_operand=30, num_eval=20, data_seed=2)
    train, evaluation = _tiny["train"], _tiny["eval"]
    return {"model": str(root / "model"), "train": str(train), "eval": str(evaluation)}


def _config(assets: dict[str, str], out: Path, layout: str, steps: int, **extra: Any) -> Any:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.sft import SFTConfig

    data: dict[str, Any] = {
        "model": assets["model"],
        "train_file": assets["train"],
        "output_dir": str(out),
        "layout": layout,
        "steps": steps,
        "global_batch_size": 11,
        "progress": False,
        "seed": 3,
        "engine": {
            "max_tokens_per_microbatch": 48,
            "optimizer": {"lr": 4e-3, "weight_decay": 0.05},
            # Explicit total: a run stopped at step 3 of 6 keeps the 6-step schedule.
            "scheduler": {"kind": "cosine", "warmup_steps": 2, "total_steps": 6},
        },
        **extra,
    }
    return build_config(SFTConfig, data)


def _run(config: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms.trainers.sft import run_sft

    summary = run_sft(config)
    return summary if dist.get_rank() == 0 else {}


def _train_records(out: Path) -> list[dict[str, Any]]:
    from shardforge.algorithms.loggers import read_metrics

    return read_metrics(out / "metrics.jsonl", "train")


def _hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def test_resume_after_kill_is_bit_identical(assets: dict[str, str], tmp_path: Path) -> None:
    pool = get_rank_pool(2)
    straight = tmp_path / "straight"
    pool.run(_run, _config(assets, straight, "d2", 6))
    resumed = tmp_path / "resumed"
    pool.run(_run, _config(assets, resumed, "d2", 3, save_every=3, export_hf_at_end=False))
    pool.close()  # kill every rank: the resumed run starts from fresh processes
    [summary] = pool.run(_run, _config(assets, resumed, "d2", 6, save_every=3))[:1]
    assert summary["resumed_from"] == 3
    a, b = _train_records(straight), _train_records(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    # Same layout, same data order, restored optimizer/schedule/RNG: exactly equal.
    assert [r["loss"] for r in a[3:]] == [r["loss"] for r in b[3:]]
    assert [r["lr"] for r in a] == [r["lr"] for r in b]
    wa, wb = _hf_weights(straight / "hf"), _hf_weights(resumed / "hf")
    assert set(wa) == set(wb)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def fsdp4_runs(assets: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The uninterrupted d2 run to 5 steps, and a d4 run saved at step 3 (shared by the targets below)."""
    root = tmp_path_factory.mktemp("reshard")
    straight, saved = root / "straight", root / "saved_d4"
    get_rank_pool(2).run(_run, _config(assets, straight, "d2", 5))
    get_rank_pool(4).run(_run, _config(assets, saved, "d4", 3, save_every=3, export_hf_at_end=False))
    return straight, saved


@pytest.mark.parametrize("target", ["r2d2", "d2t2"], ids=["fsdp4_to_hsdp2x2", "fsdp4_to_fsdp2xtp2"])
def test_resume_under_another_layout(
    assets: dict[str, str], tmp_path: Path, target: str, fsdp4_runs: tuple[Path, Path]
) -> None:
    straight, saved = fsdp4_runs
    resharded = tmp_path / "resharded"
    shutil.copytree(saved, resharded)  # each target resumes its own copy of the step-3 checkpoint
    [summary] = get_rank_pool(4).run(_run, _config(assets, resharded, target, 5, save_every=0))[:1]
    assert summary["resumed_from"] == 3
    a, b = _train_records(straight), _train_records(resharded)
    # Different reduction orders across layouts: float32 noise only (see test_sft_layouts).
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]), rtol=1e-5, atol=1e-6
    )
    wa, wb = _hf_weights(straight / "hf"), _hf_weights(resharded / "hf")
    for key, value in wa.items():
        torch.testing.assert_close(wb[key], value, rtol=1e-4, atol=2e-6)


def _engine_logprobs(model_dir: str, seqs: list[list[int]], layout: str = "d2") -> torch.Tensor:
    from shardforge.engine import TrainEngine, pack_sequences

    engine = TrainEngine(model_dir, layout)
    return engine.forward(pack_sequences(seqs))


def _values_after_load(model_dir: str, checkpoint_root: str, layout: str) -> dict[str, torch.Tensor]:
    """Full model params and AdamW moments right after loading a checkpoint under ``layout``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from shardforge.checkpoint_dcp import Checkpointer
    from shardforge.engine import TrainEngine

    engine = TrainEngine(model_dir, layout)
    assert engine.load(Checkpointer(checkpoint_root)) is not None
    full = engine.full_state_dict()
    optim = get_optimizer_state_dict(
        engine.model, engine.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() != 0:
        return {}
    for name, state in optim["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"optim/{name}/{key}"] = state[key]
    return full


def test_fsdp4_checkpoint_loads_identically_under_fsdp2_tp2(assets: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    get_rank_pool(4).run(_run, _config(assets, out, "d4", 2, save_every=2, export_hf_at_end=False))
    root = str(out / "checkpoints")
    saved = get_rank_pool(4).run(_values_after_load, assets["model"], root, "d4")[0]
    resharded = get_rank_pool(4).run(_values_after_load, assets["model"], root, "d2t2")[0]
    assert set(saved) == set(resharded) and any(k.startswith("optim/") for k in saved)
    # Loading only moves bytes between shards: values must be bit-identical.
    assert all(torch.equal(saved[k], resharded[k]) for k in saved)


_FRESH_PROCESS = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
seqs = json.loads(sys.argv[2])
out = []
for s in seqs:
    logits = model(input_ids=torch.tensor([s])).logits[0]
    lp = torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0]
    out.append([0.0] + lp.tolist())
print(json.dumps(out))
"""


def test_hf_export_loads_in_plain_transformers(assets: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    get_rank_pool(2).run(_run, _config(assets, out, "d2", 2))
    hf_dir = out / "hf"
    assert (hf_dir / "config.json").is_file() and (hf_dir / "tokenizer.json").is_file()
    seqs = [[1, 5, 9, 12, 4, 2], [1, 7, 7, 3], [1, 10, 11, 12, 13, 14, 15, 2]]
    engine_lp = get_rank_pool(2).run(_engine_logprobs, str(hf_dir), seqs)[0]
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, str(hf_dir), json.dumps(seqs)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    plain = torch.tensor([v for row in json.loads(result.stdout.strip().splitlines()[-1]) for v in row])
    # Packed attention vs HF SDPA on single sequences: same math, different kernels/order.
    torch.testing.assert_close(engine_lp, plain, rtol=1e-5, atol=1e-5)


def test_offline_converter_matches_export(assets: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    get_rank_pool(2).run(_run, _config(assets, out, "d2", 2, save_every=2))
    checkpoint = out / "checkpoints" / "step_00000002"
    converted = tmp_path / "converted"
    subprocess.run(
        [sys.executable, "-m", "shardforge.checkpoint_dcp.convert", str(checkpoint), str(converted),
         "--config", str(out / "hf"), "--max-shard-bytes", "20000"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert (converted / "model.safetensors.index.json").is_file()
    exported, offline = _hf_weights(out / "hf"), _hf_weights(converted)
    assert set(offline) == set(exported)
    assert all(torch.equal(offline[k], exported[k]) for k in exported)


def test_resume_refuses_changed_data_order(assets: dict[str, str], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.sft import run_sft

    out = tmp_path / "run"
    run_sft(_config(assets, out, "d1", 2, save_every=2, export_hf_at_end=False))
    with pytest.raises(ValueError, match="global_batch_size"):
        run_sft(_config(assets, out, "d1", 4, global_batch_size=7))
