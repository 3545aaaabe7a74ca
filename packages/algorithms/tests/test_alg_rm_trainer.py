"""Reward-model trainer: pairs packed and kept together, the Bradley-Terry loss through the engine
equals the pure function, a toy preference set is learned (loss falls, accuracy rises), resume
reproduces the next steps, and the export loads as an HF token-classification model."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _write_pairs(path: Path, count: int, seed: int) -> Path:
    # The chosen response contains a '7'; the rejected one is the same string with the '7' replaced.
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = "".join(rng.choice("0123456789+") for _ in range(rng.randint(2, 5))) + "="
        body = [rng.choice("012345689") for _ in range(rng.randint(2, 5))]
        at = rng.randrange(len(body) + 1)
        chosen = "".join([*body[:at], "7", *body[at:]])
        rejected = "".join([*body[:at], rng.choice("0123456"), *body[at:]])
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("rm")
    tokenizer = tiny_assets(root, seed=7, tokenizer_dir="model", data=False)["tokenizer"]
    return {
        "model": str(root / "model"),
        "tokenizer": tokenizer,
        "train": _write_pairs(root / "train.jsonl", 256, seed=1),
        "eval": _write_pairs(root / "eval.jsonl", 48, seed=2),
    }


def _config(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.rm import RMConfig

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "eval_file": str(assets["eval"]),
        "output_dir": str(out), "layout": "d1", "steps": 20, "global_batch_size": 8, "progress": False,
        "eval_every": 10, "eval_batch_size": 24, "export_hf_at_end": False,
        "engine": {"max_tokens_per_microbatch": 512, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    return build_config(RMConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _records(out: Path, split: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def test_bradley_terry_through_the_engine_matches_the_pure_loss(assets: dict[str, Any]) -> None:
    from shardforge.algorithms.data import load_pairs, pack_pairs
    from shardforge.algorithms.trainers.rm import BradleyTerryLossFn
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.objectives import bradley_terry_loss, last_token_scores, summarize_stats

    pairs = load_pairs(assets["eval"], assets["tokenizer"])
    tok = assets["tokenizer"]
    assert pairs[0].chosen[0] == tok.bos_token_id and pairs[0].chosen[-1] == tok.eos_token_id
    batch = pack_pairs(pairs, list(range(10)))
    engine = TrainEngine(assets["model"], "d1", EngineConfig(head="value", max_tokens_per_microbatch=40))
    scores = last_token_scores(engine.forward(batch), batch.cu_seqlens)
    want = bradley_terry_loss(scores[0::2], scores[1::2])
    fn = BradleyTerryLossFn()
    stats = engine.eval_batch(batch, fn, fn.loss_weight)
    pair_stats = summarize_stats(fn.pop_stats(), per="num_pairs")
    assert stats["loss_weight"] == 10 and pair_stats["num_pairs"] == 10
    assert stats["loss"] == pytest.approx(float(want.loss), rel=1e-5)
    assert pair_stats["accuracy"] == pytest.approx(float(want.stats["accuracy"]) / 10)
    # The budget (40 tokens) forces several micro-batches; each held whole pairs or the loss fn would raise.
    assert len(engine.runner.microbatches(batch).items) > 1
    shuffled = batch.select([1, 0, 2, 3])
    with pytest.raises(ValueError, match="whole \\(chosen, rejected\\) pairs"):
        fn(torch.zeros(shuffled.num_tokens), shuffled)


def test_rm_learns_the_toy_preference_and_resumes(assets: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForTokenClassification

    from shardforge.algorithms.trainers.rm import run_rm

    summary = run_rm(_config(assets, tmp_path / "a", save_every=10, export_hf_at_end=True))
    train, evals = _records(tmp_path / "a", "train"), _records(tmp_path / "a", "eval")
    first, last = sum(r["loss"] for r in train[:5]) / 5, sum(r["loss"] for r in train[-5:]) / 5
    assert last < first - 0.2, (first, last)  # ln 2 = 0.69 at chance
    assert evals[-1]["accuracy"] >= 0.8 and summary["eval_accuracy"] == evals[-1]["accuracy"]
    assert train[-1]["accuracy"] > train[0]["accuracy"]
    # Resume: a run stopped at step 10 and continued reproduces steps 11..20.
    run_rm(_config(assets, tmp_path / "b", steps=10, save_every=10))
    resumed = run_rm(_config(assets, tmp_path / "b", save_every=10))
    assert resumed["resumed_from"] == 10
    again = _records(tmp_path / "b", "train")
    assert [r["step"] for r in again] == list(range(1, 21))
    for key in ("loss", "accuracy", "grad_norm"):
        assert [r[key] for r in again[10:]] == [r[key] for r in train[10:]], key
    # The export is an HF reward model: its last-token scores prefer the chosen side like the trainer's.
    model = AutoModelForTokenClassification.from_pretrained(summary["hf_dir"])
    ids = assets["tokenizer"]("<bos>12=37<eos>", add_special_tokens=False)["input_ids"]
    assert model(input_ids=torch.tensor([ids])).logits.shape == (1, len(ids), 1)


def test_rm_config_errors(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.data import load_pairs
    from shardforge.algorithms.trainers.rm import run_rm

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1=", "chosen": "2"}) + "\n")
    with pytest.raises(
        ValueError,
        match=r"bad.jsonl:1: the row has fields \['chosen', 'prompt'\]; expected 'prompt'\+'chosen'\+'rejected'",
    ):
        load_pairs(bad, assets["tokenizer"])
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=10"):
        run_rm(_config(assets, tmp_path / "c", **{"engine.max_tokens_per_microbatch": 10}))


def _rm_steps(model_dir: str, pairs_file: str, layout: str) -> dict[str, Any]:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from shardforge.algorithms.data import load_pairs, pack_pairs
    from shardforge.algorithms.trainers.rm import BradleyTerryLossFn
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    pairs = load_pairs(pairs_file, AutoTokenizer.from_pretrained(model_dir))[:12]
    config = EngineConfig(head="value", max_tokens_per_microbatch=40, optimizer=OptimizerConfig(lr=1e-2, eps=1e-4))
    engine = TrainEngine(model_dir, layout, config)
    fn = BradleyTerryLossFn()
    mine = list(range(len(pairs)))[engine.dp_rank :: engine.dp_size]
    losses = [engine.train_batch(pack_pairs(pairs, mine), fn, fn.loss_weight)["loss"] for _ in range(2)]
    full = engine.full_state_dict()
    return {"losses": losses, "weights": full} if not dist.is_initialized() or dist.get_rank() == 0 else {}


def test_rm_steps_world1_match_fsdp2(assets: dict[str, Any]) -> None:
    from shardforge.mesh.testing import get_rank_pool

    single = _rm_steps(assets["model"], str(assets["eval"]), "d1")
    sharded = get_rank_pool(2).run(_rm_steps, assets["model"], str(assets["eval"]), "d2", timeout_s=300)[0]
    # Each rank holds 6 of the 12 pairs (several micro-batches each); the loss is normalised by the
    # global pair count, so the update is the same. fp32 reduction order: rounding-level differences.
    # AdamW eps 1e-4 (not 1e-6): Adam divides a near-zero gradient's rounding noise by ~eps, so at lr 1e-2 and
    # eps 1e-6 two steps turned 1e-9 of noise into 2e-5 of weight difference at 2 threads on an AMD EPYC.
    assert single["losses"][1] < single["losses"][0]
    for a, b in zip(single["losses"], sharded["losses"], strict=True):
        assert abs(a - b) <= 1e-5, (a, b)
    for key, value in sharded["weights"].items():
        torch.testing.assert_close(value, single["weights"][key], rtol=0, atol=2e-5, msg=key)
