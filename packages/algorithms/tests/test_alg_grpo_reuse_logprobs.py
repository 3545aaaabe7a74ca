"""GRPO's old log-probs from the training forward (objectives/on_policy.py): with one synchronous
update per batch the step (loss, grad norm, rollout-correction statistics, weights) equals the
recompute path's, and the recompute forward is not run; configurations where the reuse would
not be exact fall back to recomputing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.engine.objectives import RolloutCorrectionConfig
from shardforge.engine.objectives.on_policy import OnPolicyActorLossFn, correction_fits_in_loss, has_dropout

# The two paths differ only in how the old log-probs are computed: a separate eval-mode forward
# (micro-batched the same way) vs the training forward, detached. Same kernels and inputs: measured
# on this tiny model, loss, grad norm, pg loss and the weights after 3 steps are bitwise equal, the
# correction's mean weight within 2e-16 and behaviour_kl (float64 vs float32 sums) within 1e-10.
# The tolerance leaves room for another CPU's reduction order.
LOSS_TOL = 1e-6
WEIGHT_TOL = 1e-6


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("reuse")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=8, data_seed=2)
    return {"model": str(root / "model"), "train": tiny["train"]}


def _config(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(out), "layout": "d1",
        "steps": 3, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4, "temperature": 0.9,
        "progress": False, "save_every": 0, "resume": "never", "export_hf_at_end": False,
        "reward_fn": "shardforge.algorithms.testing:digit_reward",
        # Two micro-batches per step: the reuse happens per micro-batch.
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 3e-2}},
    }  # fmt: skip
    return build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _run(
    assets: dict[str, Any], out: Path, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], int]:
    from shardforge.algorithms.trainers.grpo import GRPOTrainer
    from shardforge.engine import TrainEngine

    calls = {"forward": 0}
    original = TrainEngine.forward

    def counting(self: TrainEngine, batch: Any) -> torch.Tensor:
        calls["forward"] += 1
        return original(self, batch)

    monkeypatch.setattr(TrainEngine, "forward", counting)
    trainer = GRPOTrainer(_config(assets, out, **overrides))
    trainer.run()
    monkeypatch.setattr(TrainEngine, "forward", original)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"], trainer.engine.full_state_dict(), calls["forward"]


def _compare(reuse: list[dict[str, Any]], recompute: list[dict[str, Any]], keys: list[str]) -> None:
    assert len(reuse) == len(recompute) == 3
    for a, b in zip(reuse, recompute, strict=True):
        assert a["microbatches"] >= 2, a["microbatches"]
        assert a["response_len_mean"] == b["response_len_mean"], "same samples on both paths"
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=LOSS_TOL, abs=LOSS_TOL), (key, a[key], b[key])


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # default: token_tis (cap 2) against the embedded engine's fp32 log-probs
        # bf16 rollouts: a real trainer/engine gap, and a cap low enough to truncate tokens.
        {"rollout.dtype": "bfloat16", "rollout_correction.cap": "1.001"},
    ],
    ids=["token_tis", "bf16_rollouts_truncated"],
)
def test_reuse_equals_recompute_and_skips_the_forward(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any]
) -> None:
    reuse, w_reuse, calls_reuse = _run(assets, tmp_path / "reuse", monkeypatch, **overrides)
    again, w_again, calls_again = _run(
        assets, tmp_path / "again", monkeypatch, reuse_training_logprobs="false", **overrides
    )
    assert calls_reuse == 0, "the recompute forward ran although the old log-probs came from the training forward"
    assert calls_again == 3, "the recompute path runs one forward per step"
    keys = ["loss", "grad_norm", "actor/pg_loss", "actor/ratio", "behaviour_kl"]
    keys += ["rollout_corr/kl_k1", "rollout_corr/kl_k3", "rollout_corr/weight", "rollout_corr/truncated_frac"]
    _compare(reuse, again, keys)
    assert all(r["actor/ratio"] == 1.0 for r in reuse), "the ratio is exactly 1 in value"
    assert all(r["grad_norm"] > 0 for r in reuse), "the rewards vary, so the steps move the weights"
    assert all(r["logprob_forward_s"] < 0.05 for r in reuse)
    if overrides:  # the correction really did something, identically on both paths
        assert any(r["rollout_corr/truncated_frac"] > 0 for r in reuse), reuse
    for name, value in w_again.items():
        assert torch.allclose(w_reuse[name], value, rtol=0, atol=WEIGHT_TOL), name


@pytest.mark.parametrize(
    "overrides",
    [
        {"rollout_correction.mode": "icepop"},  # masks tokens: the loss normaliser changes
        {"rollout_correction.batch_normalize": "true"},  # needs the whole batch's weights first
        {"async_rollouts": "true", "max_staleness": "0"},  # the async path keeps its proximal recompute
    ],
    ids=["masking_mode", "batch_normalize", "async"],
)
def test_configurations_where_reuse_is_not_exact_recompute(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any]
) -> None:
    records, _, calls = _run(assets, tmp_path / "x", monkeypatch, steps=1, **overrides)
    assert calls == 1 and len(records) == 1


def test_what_fits_in_the_loss_and_dropout_detection() -> None:
    from transformers import Qwen3Config

    assert correction_fits_in_loss(None)
    assert correction_fits_in_loss(RolloutCorrectionConfig(mode="token_tis"))
    assert correction_fits_in_loss(RolloutCorrectionConfig(mode="geo_tis"))
    assert correction_fits_in_loss(RolloutCorrectionConfig(mode="none"))
    assert not correction_fits_in_loss(RolloutCorrectionConfig(mode="token_mis"))
    assert not correction_fits_in_loss(RolloutCorrectionConfig(mode="bypass"))
    assert not correction_fits_in_loss(RolloutCorrectionConfig(mode="token_tis", batch_normalize=True))
    assert not has_dropout(Qwen3Config())
    assert has_dropout(Qwen3Config(attention_dropout=0.1))
    with pytest.raises(ValueError, match="cannot run inside the loss"):
        OnPolicyActorLossFn(correction=RolloutCorrectionConfig(mode="icepop"))
