"""DPO family: each loss against a float64 reference written from its paper's formula, the packed
response masks, the loss through the engine equal to the pure function on the engine's log-probs,
and `shardforge train dpo` learning a toy preference (loss falls, implicit-reward accuracy rises)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------------------------------- pure losses
def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _reference_loss(kind: str, pc, pr, rc, rr, nc, nr, beta: float, eps: float, gamma: float) -> list[float]:
    out = []
    for i in range(len(pc)):
        if kind == "sigmoid":  # Rafailov et al. 2023, eq. 7; label smoothing: Mitchell 2023
            h = (pc[i] - rc[i]) - (pr[i] - rr[i])
            out.append(-(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h))
        elif kind == "ipo":  # Azar et al. 2023, eq. 17, on per-token mean log-probs (as TRL)
            h = (pc[i] - rc[i]) / nc[i] - (pr[i] - rr[i]) / nr[i]
            out.append((h - 1 / (2 * beta)) ** 2)
        elif kind == "hinge":  # SLiC-HF calibration loss
            h = (pc[i] - rc[i]) - (pr[i] - rr[i])
            out.append(max(0.0, 1 - beta * h))
        elif kind == "simpo":  # Meng et al. 2024, eq. 6 (no reference)
            h = pc[i] / nc[i] - pr[i] / nr[i] - gamma / beta
            out.append(-(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h))
    return out


@pytest.mark.parametrize(
    ("kind", "eps"), [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0), ("simpo", 0.0), ("simpo", 0.2)]
)
def test_each_loss_matches_its_formula(kind: str, eps: float) -> None:
    from shardforge.engine.objectives import PreferenceLossConfig, preference_loss

    gen = torch.Generator().manual_seed(3)
    pc, pr, rc, rr = (-torch.rand(7, generator=gen, dtype=torch.float64) * 20 for _ in range(4))
    nc = torch.randint(1, 9, (7,), generator=gen).double()
    nr = torch.randint(1, 9, (7,), generator=gen).double()
    beta, gamma = 0.3, 0.7
    config = PreferenceLossConfig(loss_type=kind, beta=beta, label_smoothing=eps, simpo_gamma=gamma)
    policy_c, policy_r = pc.clone().requires_grad_(), pr.clone().requires_grad_()
    out = preference_loss(policy_c, policy_r, nc, nr, config, rc, rr)
    expected = _reference_loss(kind, pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), nc.tolist(), nr.tolist(),
                               beta, eps, gamma)  # fmt: skip
    assert float(out.loss_sum.detach()) == pytest.approx(sum(expected), rel=1e-12)
    assert float(out.loss_weight) == 7
    # Implicit rewards (TRL): beta * (policy - reference), per-token means for ipo / simpo, no reference for simpo.
    norm = kind in ("ipo", "simpo")
    ref_c, ref_r = (0 * rc, 0 * rr) if kind == "simpo" else (rc, rr)
    reward_c = beta * (pc - ref_c) / (nc if norm else 1)
    reward_r = beta * (pr - ref_r) / (nr if norm else 1)
    assert float(out.stats["rewards/chosen"]) == pytest.approx(float(reward_c.sum()), rel=1e-12)
    assert float(out.stats["rewards/margins"]) == pytest.approx(float((reward_c - reward_r).sum()), rel=1e-12)
    assert float(out.stats["rewards/accuracies"]) == float((reward_c > reward_r).sum())
    out.loss_sum.backward()
    assert policy_c.grad is not None and bool(torch.isfinite(policy_c.grad).all())
    if kind in ("sigmoid", "simpo") and eps == 0:  # pushing chosen up always lowers these losses
        assert bool((policy_c.grad <= 0).all())


def test_bad_settings_are_refused_with_the_valid_range() -> None:
    from shardforge.engine.objectives import PreferenceLossConfig, preference_loss

    one = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        preference_loss(one, one, one + 1, one + 1, PreferenceLossConfig(label_smoothing=0.5), one, one)
    with pytest.raises(ValueError, match="label_smoothing applies to loss_type sigmoid or simpo"):
        preference_loss(
            one, one, one + 1, one + 1, PreferenceLossConfig(loss_type="ipo", label_smoothing=0.1), one, one
        )
    with pytest.raises(ValueError, match=r"registered: \['dpo', 'hinge', 'ipo', 'sigmoid', 'simpo'\]"):
        preference_loss(one, one, one + 1, one + 1, PreferenceLossConfig(loss_type="orpo"), one, one)
    with pytest.raises(ValueError, match="needs the reference"):
        preference_loss(one, one, one + 1, one + 1, PreferenceLossConfig())
    with pytest.raises(ValueError, match="no target tokens"):
        preference_loss(one, one, one, one + 1, PreferenceLossConfig(), one, one)


def test_sequence_logprobs_sums_only_masked_tokens_per_sequence() -> None:
    from shardforge.engine.objectives import sequence_logprobs

    logprobs = torch.tensor([0.0, -1.0, -2.0, 0.0, -4.0, -8.0, -16.0])
    mask = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    sums, counts = sequence_logprobs(logprobs, mask, torch.tensor([0, 3, 7], dtype=torch.int32))
    assert sums.tolist() == [-2.0, -20.0] and counts.tolist() == [1.0, 2.0]


# ---------------------------------------------------------------------------------------- data + engine
def _write_pairs(path: Path, count: int, seed: int) -> Path:
    # The chosen response contains a '7'; the rejected one is the same string with the '7' replaced.
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = "".join(rng.choice("0123456789+") for _ in range(rng.randint(2, 5))) + "="
        body = [rng.choice("012345689") for _ in range(rng.randint(1, 3))]
        at = rng.randrange(len(body) + 1)
        rows.append({"prompt": prompt, "chosen": "".join([*body[:at], "7", *body[at:]]),
                     "rejected": "".join([*body[:at], rng.choice("0123456"), *body[at:]])})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("dpo")
    tokenizer = tiny_assets(root, seed=7, tokenizer_dir="model", data=False)["tokenizer"]
    return {
        "model": str(root / "model"),
        "tokenizer": tokenizer,
        "train": _write_pairs(root / "train.jsonl", 128, seed=1),
        "eval": _write_pairs(root / "eval.jsonl", 24, seed=2),
    }


def test_pairs_mask_only_response_tokens_also_after_truncation(assets: dict[str, Any]) -> None:
    from shardforge.algorithms.data import load_pairs, pack_pairs

    tok = assets["tokenizer"]
    row = json.loads(Path(assets["train"]).read_text().splitlines()[0])
    [pair] = load_pairs(_one_row(assets, row), tok)
    prompt_len = 1 + len(tok(row["prompt"], add_special_tokens=False)["input_ids"])  # bos + prompt
    assert pair.chosen_prompt_len == pair.rejected_prompt_len == prompt_len
    batch = pack_pairs([pair], [0], responses_only=True)
    lengths = batch.seq_lens
    chosen_mask = batch.loss_mask[: lengths[0]].tolist()
    assert chosen_mask == [0.0] * prompt_len + [1.0] * (lengths[0] - prompt_len)  # response + eos
    assert pack_pairs([pair], [0]).loss_mask[1:].sum() == batch.num_tokens - 2  # RM: every token after the first
    with pytest.warns(UserWarning, match="truncated to their last"):
        [cut] = load_pairs(_one_row(assets, row), tok, max_seq_len=len(pair.chosen) - 2)
    assert (
        cut.chosen_prompt_len == prompt_len - 2
        and len(cut.chosen) - cut.chosen_prompt_len == len(pair.chosen) - prompt_len
    )


def _one_row(assets: dict[str, Any], row: dict[str, str]) -> Path:
    path = Path(assets["model"]).parent / "one.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def test_loss_through_the_engine_equals_the_pure_function(assets: dict[str, Any]) -> None:
    from shardforge.algorithms.data import load_pairs, pack_pairs
    from shardforge.algorithms.trainers.dpo import REF_LOGPROBS, DPOLossFn
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.objectives import PreferenceLossConfig, preference_loss, sequence_logprobs

    pairs = load_pairs(assets["eval"], assets["tokenizer"])
    engine = TrainEngine(assets["model"], "d1", EngineConfig(max_tokens_per_microbatch=40))
    batch = pack_pairs(pairs, list(range(12)), responses_only=True)
    logprobs = engine.forward(batch)
    ref = logprobs + 0.05 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0))
    batch.extras[REF_LOGPROBS] = ref
    config = PreferenceLossConfig(beta=0.5)
    loss_fn = DPOLossFn(config)
    stats = engine.eval_batch(batch, loss_fn, loss_fn.loss_weight)  # several micro-batches of whole pairs
    sums, counts = sequence_logprobs(logprobs.double(), batch.loss_mask, batch.cu_seqlens)
    ref_sums, _ = sequence_logprobs(ref.double(), batch.loss_mask, batch.cu_seqlens)
    pure = preference_loss(sums[0::2], sums[1::2], counts[0::2], counts[1::2], config, ref_sums[0::2], ref_sums[1::2])
    assert stats["loss_weight"] == 12
    assert stats["loss"] == pytest.approx(float(pure.loss_sum) / 12, rel=1e-5)
    assert loss_fn.pop_stats(engine)["rewards/margins"] == pytest.approx(float(pure.stats["rewards/margins"]) / 12,
                                                                          rel=1e-4, abs=1e-6)  # fmt: skip


def _config(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.dpo import DPOConfig

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "eval_file": str(assets["eval"]),
        "output_dir": str(out), "layout": "d1", "steps": 12, "global_batch_size": 16, "progress": False,
        "eval_every": 0, "eval_batch_size": 24, "export_hf_at_end": False, "beta": 0.5,
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    return build_config(DPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _records(out: Path, split: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_dpo_learns_a_toy_preference(assets: dict[str, Any], tmp_path: Path, loss_type: str) -> None:
    from shardforge.algorithms.trainers.dpo import DPOTrainer

    extra = {"beta": 2.0, "simpo_gamma": 0.5} if loss_type == "simpo" else {}
    trainer = DPOTrainer(_config(assets, tmp_path, loss_type=loss_type, **extra))
    summary = trainer.run()
    assert (trainer.reference is None) == (loss_type == "simpo")  # SimPO builds no reference model
    train = _records(tmp_path, "train")
    assert [r["step"] for r in train] == list(range(1, 13))
    if loss_type == "sigmoid":  # policy == reference at step 1: h = 0 and the loss is log 2 exactly
        assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert train[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    [first_eval, last_eval] = _records(tmp_path, "eval")[:1] + _records(tmp_path, "eval")[-1:]
    assert last_eval["loss"] < train[0]["loss"] - 0.05
    assert last_eval["rewards/accuracies"] >= 0.75, last_eval
    assert summary["steps"] == 12 and first_eval is not None
