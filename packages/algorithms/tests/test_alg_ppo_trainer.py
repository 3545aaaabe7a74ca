"""PPO actor-critic trainer (world 1): a few steps end to end on the tiny demo model with a critic,
KL-in-reward against a reference policy, metrics, exports and resume; GAE/whitening on a batch."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

REWARD_MODULE = textwrap.dedent(
    """
    def has_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)
    """
)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("ppo")
    _tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=16, data_seed=2)
    tokenizer, train, evaluation = _tiny["tokenizer"], _tiny["train"], _tiny["eval"]
    (root / "ppo_rewards_mod.py").write_text(REWARD_MODULE)
    sys.path.insert(0, str(root))
    return {"root": root, "tokenizer": tokenizer, "model": str(root / "model"), "train": train, "eval": evaluation}


def _config(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.ppo import PPOConfig

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "eval_file": str(assets["eval"]),
        "output_dir": str(out), "layout": "d1", "steps": 4, "prompts_per_step": 4, "group_size": 2,
        "max_new_tokens": 4, "reward_fn": "ppo_rewards_mod:has_seven", "progress": False, "save_every": 2,
        "eval_size": 8, "export_hf_at_end": False, "kl_coef": 0.05,
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 3e-3}},
        "critic_engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-2}},
    }  # fmt: skip
    return build_config(PPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _train_records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_ppo_runs_end_to_end_and_resumes(assets: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from shardforge.algorithms.trainers.ppo import run_ppo

    summary = run_ppo(_config(assets, tmp_path / "a", export_hf_at_end=True))
    records = _train_records(tmp_path / "a")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("reward_mean", "critic/loss", "critic/value_clip_frac", "explained_variance", "actor/clip_frac",
                "actor/approx_kl", "kl_ref", "loss", "grad_norm", "critic/grad_norm", "weight_sync_s"):  # fmt: skip
        assert all(math.isfinite(r[key]) for r in records), key
    assert records[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6), "the actor starts as the reference"
    assert records[-1]["kl_ref"] != 0.0, "the actor moved away from the reference"
    assert any(r["critic/loss"] > 0 for r in records) and any(r["reward_std"] > 0 for r in records)
    # update_epochs=2 (default): the second optimizer step of each batch sees moved ratios/values.
    assert any(r["actor/clip_frac"] > 0 for r in records) and any(r["critic/value_clip_frac"] > 0 for r in records)
    assert [r["rollout_version"] for r in records] == [1.0, 2.0, 3.0, 4.0]
    assert "accuracy_start" in summary and "accuracy_end" in summary
    AutoModelForCausalLM.from_pretrained(summary["hf_dir"])
    critic = AutoModelForTokenClassification.from_pretrained(summary["critic_hf_dir"])
    assert critic.config.num_labels == 1
    # Resume: stopping after step 2 and continuing reproduces steps 3 and 4 (actor and critic).
    from shardforge.algorithms.trainers.ppo import run_ppo as again

    # The resumed run also keeps the reference and the critic offloaded between uses: same numbers.
    offload = {"offload_reference": "true", "critic_engine.offload_when_idle": "true"}
    again(_config(assets, tmp_path / "b", steps=2, **offload))
    again(_config(assets, tmp_path / "b", **offload))
    resumed = _train_records(tmp_path / "b")
    for key in ("loss", "critic/loss", "reward_mean", "explained_variance"):
        assert [r[key] for r in resumed[-2:]] == [r[key] for r in records[2:]], key
    with pytest.raises(ValueError, match=r"cannot resume.*update_epochs: checkpoint 2 vs config 1"):
        again(_config(assets, tmp_path / "b", steps=5, update_epochs=1))


def test_ppo_critic_from_a_value_model_dir_and_errors(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.ppo import run_ppo
    from shardforge.engine import EngineConfig, TrainEngine

    rm = TrainEngine(assets["model"], "d1", EngineConfig(head="value", seed=4))
    rm.export_hf(tmp_path / "rm")
    summary = run_ppo(_config(assets, tmp_path / "c", critic_model=str(tmp_path / "rm"), steps=1, kl_coef=0.0))
    assert math.isfinite(summary["reward_mean"])
    with pytest.raises(ValueError, match="group_size=0 must be >= 1"):
        run_ppo(_config(assets, tmp_path / "d", group_size=0))
    with pytest.raises(ValueError, match="max_tokens_per_microbatch of engine/critic_engine is 8"):
        run_ppo(_config(assets, tmp_path / "e", **{"critic_engine.max_tokens_per_microbatch": 8}))


def test_prepare_ppo_batch_gae_and_whitening(assets: dict[str, Any]) -> None:
    from shardforge.algorithms.trainers.rl.ppo_update import prepare_ppo_batch
    from shardforge.engine import EngineConfig, TrainEngine, pack_sequences
    from shardforge.engine.batching import target_aligned_values
    from shardforge.engine.objectives import gae_advantages, token_rewards

    actor = TrainEngine(assets["model"], "d1")
    critic = TrainEngine(assets["model"], "d1", EngineConfig(head="value"))
    seqs = [[1, 5, 6, 7, 8], [1, 9, 10, 2], [1, 4, 4, 4, 4, 2]]
    batch = pack_sequences(seqs, [[float(t >= 2) for t in range(len(s))] for s in seqs])
    rewards = torch.tensor([1.0, 0.0, 0.5])
    stats = prepare_ppo_batch(batch, rewards, actor, critic, None, gamma=0.9, lam=0.8, whiten_advantages=False)
    values = target_aligned_values(critic.forward(batch), batch.cu_seqlens) * batch.loss_mask
    want_adv, want_ret = gae_advantages(
        token_rewards(rewards, batch.loss_mask, batch.cu_seqlens), values, batch.loss_mask, batch.cu_seqlens,
        gamma=0.9, lam=0.8,
    )  # fmt: skip
    torch.testing.assert_close(batch.extras["advantages"], want_adv)
    torch.testing.assert_close(batch.extras["returns"], want_ret)
    torch.testing.assert_close(batch.extras["old_values"], values)
    assert stats["kl_ref"] == 0.0 and math.isfinite(stats["explained_variance"])
    prepare_ppo_batch(batch, rewards, actor, critic, None, gamma=0.9, lam=0.8, whiten_advantages=True)
    picked = batch.extras["advantages"][batch.loss_mask != 0]
    assert abs(float(picked.mean())) < 1e-5 and float(picked.std(correction=0)) == pytest.approx(1.0, rel=1e-4)
