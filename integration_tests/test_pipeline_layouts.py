"""Pipeline parallelism through the real SFT trainer: loss curves and weights under pp2 x FSDP2,
pp2 x TP2 and interleaved / zero-bubble schedules match world 1; `forward` (RL log-probs) under
PP equals world 1; a checkpoint saved under pp2 x FSDP2 loads bit-identically under FSDP4 (pp1).

The tiny Qwen3 has 4 layers, so pp2 with 2 virtual stages per rank has one layer per stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

STEPS = 5


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("pp_assets")
    _tiny = tiny_assets(root, seed=5, layers=4, max_operand=30, num_eval=20, data_seed=4)
    train, evaluation = _tiny["train"], _tiny["eval"]
    return {"model": str(root / "model"), "train": str(train), "eval": str(evaluation)}


def _config(
    assets: dict[str, str], out: Path, layout: str, steps: int = STEPS, sft: dict[str, Any] | None = None, **engine: Any
) -> Any:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.sft import SFTConfig

    data: dict[str, Any] = {
        "model": assets["model"],
        "train_file": assets["train"],
        "eval_file": assets["eval"],
        "output_dir": str(out),
        "layout": layout,
        "steps": steps,
        # 13 sequences: data-parallel ranks get unequal shares and micro-batch counts differ.
        "global_batch_size": 13,
        "eval_every": 2,
        "eval_batch_size": 7,
        "progress": False,
        "engine": {
            "max_tokens_per_microbatch": 40,
            "optimizer": {"lr": 5e-3, "weight_decay": 0.1, "max_grad_norm": 0.5},
            "scheduler": {"kind": "cosine", "warmup_steps": 2},
            **engine,
        },
        **(sft or {}),
    }
    return build_config(SFTConfig, data)


def _run(config: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms.trainers.sft import run_sft

    summary = run_sft(config)
    return summary if dist.get_rank() == 0 else {}


def _curves(out: Path) -> tuple[list[float], list[float]]:
    from shardforge.algorithms.loggers import read_metrics

    path = out / "metrics.jsonl"
    return [r["loss"] for r in read_metrics(path, "train")], [r["loss"] for r in read_metrics(path, "eval")]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((out / "hf").glob("*.safetensors"))
    assert files, f"no exported safetensors in {out}/hf"
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


@pytest.fixture(scope="module")
def reference(assets: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardforge.algorithms.trainers.sft import run_sft

    out = tmp_path_factory.mktemp("pp_world1")
    run_sft(_config(assets, out, "d1"))
    return out


@pytest.mark.parametrize(
    ("world", "layout", "engine"),
    [
        (4, "p2d2", {}),
        # heavy (~31 s): CI keeps PP composed with FSDP and TP with FSDP (test_sft_layouts fsdp2xtp2)
        pytest.param(4, "p2t2", {"pp_schedule": "GPipe"}, marks=pytest.mark.heavy),
        (2, "p2", {"pp_schedule": "Interleaved1F1B"}),
        (2, "p2", {"pp_schedule": "ZBVZeroBubble"}),
    ],
    ids=["pp2xfsdp2-1f1b", "pp2xtp2-gpipe", "pp2-interleaved", "pp2-zbv"],
)
def test_sft_under_pp_matches_world1(
    world: int, layout: str, engine: dict[str, Any], assets: dict[str, str], reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / layout
    [summary, *_] = get_rank_pool(world).run(_run, _config(assets, out, layout, **engine))
    assert summary["steps"] == STEPS
    ref_train, ref_eval = _curves(reference)
    train, evaluation = _curves(out)
    assert len(train) == len(ref_train) == STEPS
    assert len(evaluation) == len(ref_eval) == 3
    # Same tolerances as the FSDP/TP layouts (test_sft_layouts.py): reductions in a different
    # order (per-stage grad norms summed over pp, reduce-scatter over FSDP ranks) differ in the
    # last float32 bits, which 5 Adam steps amplify to ~1e-6 relative. Padding every
    # micro-batch to the static length adds no loss weight, so it changes nothing else.
    torch.testing.assert_close(torch.tensor(train), torch.tensor(ref_train), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(evaluation), torch.tensor(ref_eval), rtol=1e-5, atol=1e-6)
    ref_weights, weights = _weights(reference), _weights(out)
    assert set(weights) == set(ref_weights)
    for name, value in ref_weights.items():
        # 1% of one Adam step (lr 5e-3); a missing stage or micro-batch moves weights by whole steps.
        torch.testing.assert_close(weights[name], value, rtol=0, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}")


def _forward(model_dir: str, layout: str) -> torch.Tensor:
    from shardforge.engine import TrainEngine
    from shardforge.engine.batching import pack_sequences
    from shardforge.engine.config import EngineConfig

    engine = TrainEngine(model_dir, layout, EngineConfig(max_tokens_per_microbatch=24))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 20, (n,), generator=gen).tolist() for n in (7, 12, 5, 9, 3)]
    return engine.forward(pack_sequences(seqs))


def test_forward_logprobs_under_pp_match_world1(assets: dict[str, str]) -> None:
    expected = get_rank_pool(2).run(_forward, assets["model"], "d2")[0]
    for got in get_rank_pool(2).run(_forward, assets["model"], "p2"):
        # Every pp rank gets the last stage's log-probs; the same ops run split over two ranks.
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert expected.abs().sum() > 0


def _values_after_load(model_dir: str, checkpoint_root: str, layout: str, engine: dict[str, Any]) -> dict[str, Any]:
    """Every param and AdamW moment this rank holds (full tensors), right after loading a checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from shardforge.checkpoint_dcp import Checkpointer
    from shardforge.engine import TrainEngine
    from shardforge.engine.config import EngineConfig

    trainer = TrainEngine(model_dir, layout, EngineConfig(**engine))
    assert trainer.load(Checkpointer(checkpoint_root)) is not None
    options = StateDictOptions(full_state_dict=True)
    values: dict[str, Any] = {
        k: v.detach().cpu() for k, v in get_model_state_dict(trainer.model, options=options).items()
    }
    optim = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)
    for name, state in optim["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            values[f"optim/{name}/{key}"] = state[key].detach().cpu()
    return values


def test_pp2_checkpoint_loads_identically_under_pp1(assets: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    get_rank_pool(4).run(_run, _config(assets, out, "p2d2", 2, sft={"save_every": 2, "export_hf_at_end": False}))
    root = str(out / "checkpoints")
    merged: dict[str, torch.Tensor] = {}
    for per_rank in get_rank_pool(4).run(_values_after_load, assets["model"], root, "p2d2", {}):
        merged.update(per_rank)
    unsplit = get_rank_pool(4).run(_values_after_load, assets["model"], root, "d4", {})[0]
    # The pp2 ranks together hold every parameter and moment exactly once, under global names.
    assert set(merged) == set(unsplit) and any(k.startswith("optim/") for k in unsplit)
    assert any(".layers.3." in k for k in unsplit)
    # Loading only moves bytes between shards and stages: values must be bit-identical.
    assert all(torch.equal(merged[k], unsplit[k]) for k in unsplit)
