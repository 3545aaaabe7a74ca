"""The SFT trainer on a 2-source mixture (a JSONL file + a Parquet file with its own column names), world 1:
a run resumed mid-mixture trains on exactly the batches of an uninterrupted run, a resume with changed
weights continues each source from its checkpointed position, and the dry run lists the sources."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

import shardforge.algorithms.data.rows as sft_module
from shardforge.algorithms.cli.main import main
from shardforge.algorithms.config_io import build_config
from shardforge.algorithms.data.mixture import MixtureSampler
from shardforge.algorithms.trainers.sft import SFTConfig, run_sft


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("mix")
    made = tiny_assets(root, seed=5, max_operand=9, num_eval=8)
    rows = [json.loads(line) for line in Path(made["eval"]).read_text().splitlines() if line.strip()]
    qa = root / "qa.parquet"
    datasets.Dataset.from_list([{"question": r["prompt"], "answer": r["completion"]} for r in rows]).to_parquet(str(qa))
    return {"model": str(made["model"]), "train": str(made["train"]), "qa": str(qa)}


def _mix(assets: dict[str, Any], weights: tuple[float, float] = (0.7, 0.3)) -> list[dict[str, Any]]:
    return [
        {"source": assets["train"], "name": "adds", "weight": weights[0]},
        {"source": assets["qa"], "name": "qa", "weight": weights[1], "columns": {"prompt": "question", "completion": "answer"}},
    ]  # fmt: skip


def _config(assets: dict[str, Any], out: Path, steps: int, weights: tuple[float, float] = (0.7, 0.3)) -> SFTConfig:
    return build_config(
        SFTConfig,
        {
            "model": assets["model"], "output_dir": str(out), "layout": "d1", "steps": steps, "save_every": 2,
            "global_batch_size": 4, "progress": False, "export_hf_at_end": False, "loggers": ["jsonl"],
            "data": {"mix": _mix(assets, weights)}, "engine": {"max_tokens_per_microbatch": 64},
        },
    )  # fmt: skip


def _record(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The example indices of every training batch (SFT packs each step's local batch once)."""
    seen: list[list[int]] = []
    original = sft_module.pack_examples

    def recording(examples: Any, indices: list[int]) -> Any:
        seen.append(list(indices))
        return original(examples, indices)

    monkeypatch.setattr(sft_module, "pack_examples", recording)
    return seen


def test_resume_mid_mixture_trains_the_same_batches(tmp_path, assets, monkeypatch):
    seen = _record(monkeypatch)
    run_sft(_config(assets, tmp_path / "full", steps=4))
    full = list(seen)
    seen.clear()
    run_sft(_config(assets, tmp_path / "cut", steps=2))
    summary = run_sft(_config(assets, tmp_path / "cut", steps=4))
    assert summary["resumed_from"] == 2
    assert seen == full  # steps 1-2, then (resumed) 3-4: the uninterrupted run's batches
    sizes = [sum(1 for line in open(assets["train"]) if line.strip()), 8]
    assert {i < sizes[0] for batch in full for i in batch} == {True, False}  # rows of both sources were trained

    # A resume with new weights continues each source where the checkpoint left it (no replay under the new ones).
    seen.clear()
    run_sft(_config(assets, tmp_path / "cut", steps=6, weights=(0.2, 0.8)))
    old = MixtureSampler(sizes, [0.7, 0.3], 4, names=["adds", "qa"], seed=0)
    for step in range(4):
        old.global_batch(step)
    new = MixtureSampler(sizes, [0.2, 0.8], 4, names=["adds", "qa"], seed=0)
    new.load_state_dict(old.state_dict())
    expected = [[s * sizes[0] + row for s, row in new.global_batch(step)] for step in (4, 5)]
    assert seen == expected


def test_dry_run_lists_every_source_with_rows_and_share(tmp_path, assets, capsys):
    import yaml

    config = tmp_path / "c.yaml"
    data = {"model": assets["model"], "output_dir": str(tmp_path / "run"), "global_batch_size": 4,
            "data": {"mix": _mix(assets), "eval": {"source": assets["qa"], "columns": {"prompt": "question", "completion": "answer"}}},
            "engine": {"max_tokens_per_microbatch": 64}}  # fmt: skip
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["train", "sft", "--config", str(config), "--dry-run", "layout=d1"]) == 0
    out = capsys.readouterr().out
    train_rows = sum(1 for line in open(assets["train"]) if line.strip())
    assert f"data.mix[0] [adds]: {assets['train']} ({train_rows} rows, weight 0.7 = 70% of samples)" in out
    assert (
        f"data.mix[1] [qa]: {assets['qa']} columns=prompt<-question,completion<-answer (8 rows, weight 0.3 = 30%" in out
    )
    assert f"data.eval: {assets['qa']} columns=prompt<-question,completion<-answer (8 rows)" in out
    # a bad column mapping is refused before launch, naming the columns found
    data["data"]["mix"][1]["columns"] = {"prompt": "q", "completion": "answer"}
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["train", "sft", "--config", str(config), "--dry-run", "layout=d1"]) == 1
    assert "has no column 'q' (for 'prompt'); its columns are ['question', 'answer']" in capsys.readouterr().err
