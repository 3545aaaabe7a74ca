"""End-to-end SFT parity: the real trainer (`run_sft`) under world 1, FSDP 2, FSDP 4,
HSDP 2x2, FSDP 2 x TP 2 and FSDP 2 x CP 2 (Ulysses) produces the same loss curve and the same final weights.

The model, tokenizer and data are built locally and saved with `save_pretrained`, so the
real loading paths run. World 1 runs in this process without a process group; the others
run on the shared gloo rank pools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import RankFailure, get_rank_pool

STEPS = 5


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("sft_assets")
    _tiny = tiny_assets(root, seed=3, max_operand=30, num_eval=20, data_seed=1)
    train, evaluation = _tiny["train"], _tiny["eval"]
    return {"model": str(root / "model"), "train": str(train), "eval": str(evaluation), "root": str(root)}


def _config(assets: dict[str, str], out: str, layout: str, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.sft import SFTConfig

    data: dict[str, Any] = {
        "model": assets["model"],
        "train_file": assets["train"],
        "eval_file": assets["eval"],
        "output_dir": out,
        "layout": layout,
        "steps": STEPS,
        # 13 sequences: an odd count, so data-parallel ranks get unequal shares.
        "global_batch_size": 13,
        "eval_every": 2,
        "eval_batch_size": 7,
        "progress": False,
        "engine": {
            # A small budget forces several micro-batches, and different counts per rank.
            "max_tokens_per_microbatch": 40,
            "optimizer": {"lr": 5e-3, "weight_decay": 0.1, "max_grad_norm": 0.5},
            "scheduler": {"kind": "cosine", "warmup_steps": 2},
        },
    }
    return build_config(SFTConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _run_sft_on_rank(config: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms.trainers.sft import run_sft

    summary = run_sft(config)
    return summary if dist.get_rank() == 0 else {}


def _curves(out: str) -> tuple[list[float], list[float]]:
    from shardforge.algorithms.loggers import read_metrics

    path = Path(out) / "metrics.jsonl"
    return [r["loss"] for r in read_metrics(path, "train")], [r["loss"] for r in read_metrics(path, "eval")]


def _weights(out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((Path(out) / "hf").glob("*.safetensors"))
    assert files, f"no exported safetensors in {out}/hf"
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


@pytest.fixture(scope="module")
def reference(assets: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    from shardforge.algorithms.trainers.sft import run_sft

    out = str(tmp_path_factory.mktemp("sft_world1"))
    run_sft(_config(assets, out, "d1"))
    return out


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        pytest.param(2, "d2", id="fsdp2"),
        pytest.param(4, "d4", id="fsdp4"),
        pytest.param(4, "r2d2", id="hsdp2x2"),
        pytest.param(4, "d2t2", id="fsdp2xtp2"),
        pytest.param(4, "d2c2", id="fsdp2xcp2"),
        # heavy (~55 s): CI keeps TP and CP each composed with FSDP (fsdp2xtp2, fsdp2xcp2)
        pytest.param(4, "c2t2", id="cp2xtp2", marks=pytest.mark.heavy),
        pytest.param(2, "c2", id="cp2"),
    ],
)
def test_sft_matches_world1(world: int, layout: str, assets: dict[str, str], reference: str, tmp_path: Path) -> None:
    out = str(tmp_path / layout)
    [summary, *_] = get_rank_pool(world).run(_run_sft_on_rank, _config(assets, out, layout))
    assert summary["steps"] == STEPS
    ref_train, ref_eval = _curves(reference)
    train, evaluation = _curves(out)
    assert len(train) == len(ref_train) == STEPS
    assert len(evaluation) == len(ref_eval) == 3  # steps 2, 4 and the last
    # Sharded runs reduce gradients in a different order (reduce-scatter over ranks), so
    # float32 sums differ in the last bits; 5 Adam steps amplify that to ~1e-6 relative.
    torch.testing.assert_close(torch.tensor(train), torch.tensor(ref_train), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(evaluation), torch.tensor(ref_eval), rtol=1e-5, atol=1e-6)
    ref_weights, weights = _weights(reference), _weights(out)
    assert set(weights) == set(ref_weights)
    for name, value in ref_weights.items():
        # Adam normalises each update by sqrt(v): for the rare weight whose gradient is ~eps
        # (1e-8), 1e-7-level summation noise changes its step by a visible fraction of lr.
        # Bound: 1% of one step (lr = 5e-3). A wrong reduction or a missing rank moves
        # weights by whole steps, far above this.
        torch.testing.assert_close(weights[name], value, rtol=0, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}")
    # The loss actually moved: the test would not pass on a no-op trainer.
    assert ref_train[-1] < ref_train[0]


def test_world1_weights_changed(assets: dict[str, str], reference: str) -> None:
    from safetensors.torch import load_file

    initial = load_file(str(next(Path(assets["model"]).glob("*.safetensors"))))
    final = _weights(reference)
    changed = [n for n in initial if not torch.equal(initial[n], final[n])]
    assert len(changed) == len(initial)


def test_metrics_and_summary_written(reference: str) -> None:
    summary = json.loads((Path(reference) / "summary.json").read_text())
    assert summary["steps"] == STEPS and "eval_loss" in summary
    config = json.loads((Path(reference) / "config.json").read_text())
    assert config["engine"]["max_tokens_per_microbatch"] == 40
    assert (Path(reference) / "tensorboard").is_dir()


def test_wrong_world_size_fails_before_any_collective(assets: dict[str, str], tmp_path: Path) -> None:
    # d4 on 2 ranks: every rank must raise the layout error itself (no rank waits in a collective).
    with pytest.raises(RankFailure) as info:
        get_rank_pool(2).run(_run_sft_on_rank, _config(assets, str(tmp_path), "d4"), grace_s=120.0)
    assert sorted(info.value.errors) == [0, 1]
    for text in info.value.errors.values():
        assert "world_size=2" in text and "divisors" in text


# heavy (~27 s): the message is checked at world 1 by test_alg_cli.py; this shows both ranks raise it.
@pytest.mark.heavy
def test_sequence_longer_than_budget_fails_on_every_rank(assets: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as info:
        # Each rank checks its own data before any collective; on a loaded machine the second may get
        # there many seconds after the first (the pool's default grace of 5 s once failed on CI-like load).
        get_rank_pool(2).run(
            _run_sft_on_rank,
            _config(assets, str(tmp_path), "d2", **{"engine.max_tokens_per_microbatch": 4}),
            grace_s=120.0,
        )
    assert sorted(info.value.errors) == [0, 1]
    assert all("max_tokens_per_microbatch" in text for text in info.value.errors.values())


def _parameter_kinds(model_dir: str, data_parallel: str) -> list[str]:
    from torch.distributed.tensor import DTensor

    from shardforge.engine import EngineConfig, TrainEngine

    engine = TrainEngine(model_dir, "r2", EngineConfig(data_parallel=data_parallel))
    return sorted({"DTensor" if isinstance(p, DTensor) else "Tensor" for p in engine.model.parameters()})


def test_sft_ddp_matches_world1(assets: dict[str, str], reference: str, tmp_path: Path) -> None:
    """`engine.data_parallel=ddp` on `r2`: whole replicas, bucketed all-reduce; same curve and weights."""
    out = str(tmp_path / "r2_ddp")
    get_rank_pool(2).run(_run_sft_on_rank, _config(assets, out, "r2", **{"engine.data_parallel": "ddp"}))
    ref_train, ref_eval = _curves(reference)
    train, evaluation = _curves(out)
    # DDP all-reduces gradients in buckets (a different summation order than one process): the
    # same float32-noise bound as the FSDP layouts above.
    torch.testing.assert_close(torch.tensor(train), torch.tensor(ref_train), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(evaluation), torch.tensor(ref_eval), rtol=1e-5, atol=1e-6)
    ref_weights, weights = _weights(reference), _weights(out)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}")
    # The layout really is DDP (plain replicated tensors), and fsdp on the same layout shards.
    assert get_rank_pool(2).run(_parameter_kinds, assets["model"], "ddp") == [["Tensor"], ["Tensor"]]
    assert get_rank_pool(2).run(_parameter_kinds, assets["model"], "fsdp") == [["DTensor"], ["DTensor"]]
