"""ReMax in the GRPO trainer (one greedy episode per prompt; its reward is the samples' baseline) and
the adaptive KL controller driven from the PPO config (the in-reward KL coefficient follows
``beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon`` step by step)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    return tiny_assets(tmp_path_factory.mktemp("remax"), seed=4, tokenizer_dir="model")


def _grpo(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(out), "layout": "d1",
        "steps": 2, "prompts_per_step": 4, "group_size": 3, "max_new_tokens": 5, "progress": False,
        "export_hf_at_end": False, "advantage": "remax", "engine": {"max_tokens_per_microbatch": 256},
    }  # fmt: skip
    return build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _length_reward(prompt: str, response: str, reference: str) -> float:
    return float(len(response))  # varies with the sample: a greedy baseline that is easy to recompute


def test_remax_baseline_is_the_reward_of_each_prompts_greedy_response(assets: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from shardforge.algorithms.data.prompts import load_prompts
    from shardforge.algorithms.trainers.rl.advantages import greedy_baseline
    from shardforge.algorithms.trainers.rl.sampling import build_rl_workflow, workflow_round_fn
    from shardforge.engine.objectives.rewards import shape_rewards
    from shardforge.rollout import HFRolloutEngine, SamplingParams

    config = _grpo(assets, tmp_path, **{"reward_shaping.scale": 0.5})
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    prompts = load_prompts(config.train_file, tokenizer)
    rollout = HFRolloutEngine(config.model, tokenizer, weights_root=tmp_path / "w")
    workflow = build_rl_workflow(config, tokenizer, _length_reward, 256)
    engine = SimpleNamespace(dp_rank=0, dp_size=1)
    baseline = greedy_baseline(config.advantage, config.reward_shaping)  # the remax estimator's
    round_fn = workflow_round_fn(config, rollout, prompts, workflow, engine, baseline=baseline)  # type: ignore[arg-type]
    trajectories, _ = round_fn(1, 0)
    assert len(trajectories) == 4 * 3
    for first in trajectories[::3]:
        prompt_ids = first.token_ids[: first.loss_mask.index(1)]
        [greedy] = rollout.generate([prompt_ids], SamplingParams(max_new_tokens=5, temperature=0.0))
        want = shape_rewards(torch.tensor([float(len(greedy.text))]), config.reward_shaping)
        group = [t for t in trajectories if t.group == first.group]
        assert [t.baseline_reward for t in group] == pytest.approx([float(want[0])] * 3)
    samples = {len(t.text) for t in trajectories}
    assert len(samples) > 1  # sampled lengths vary, so r - b is not a constant


def test_grpo_trains_with_remax_and_logs_the_baseline(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    out = tmp_path / "out"
    run_grpo(_grpo(assets, out))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 2
    assert all(0.0 <= r["remax/baseline_mean"] <= 1.0 for r in train)  # exact_match of the greedy answers


def test_remax_with_a_reward_model_is_refused(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    with pytest.raises(ValueError, match="advantage=remax with reward_model"):
        run_grpo(_grpo(assets, tmp_path / "o", **{"reward_model.path": assets["model"]}))


def _ppo(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.ppo import PPOConfig

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(out), "layout": "d1",
        "steps": 2, "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 4, "progress": False,
        "save_every": 1, "export_hf_at_end": False, "kl_coef": 0.05, "update_epochs": 1,
        "kl_ctrl": {"type": "adaptive", "target_kl": 1e-4, "horizon": 20},
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 3e-2}},
        "critic_engine": {"max_tokens_per_microbatch": 64},
    }  # fmt: skip
    return build_config(PPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _adaptive(beta: float, kl: float, target: float = 1e-4, n: int = 8, horizon: int = 20) -> float:
    """Ziegler et al. 2019, written out here: beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)."""
    return beta * (1.0 + min(max(kl / target - 1.0, -0.2), 0.2) * n / horizon)


def test_ppo_adaptive_kl_coefficient_follows_the_controller_and_survives_resume(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    from shardforge.algorithms.trainers.ppo import run_ppo

    out = tmp_path / "out"
    run_ppo(_ppo(assets, out))
    run_ppo(_ppo(assets, out, steps=3))  # resumes from step 2's checkpoint
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert train[0]["kl_coef"] == 0.05
    assert train[0]["kl_ref"] > 0 or train[1]["kl_ref"] > 0  # the first update moves the actor off the reference
    for before, after in itertools.pairwise(train):
        assert after["kl_coef"] == pytest.approx(_adaptive(before["kl_coef"], before["kl_ref"]), rel=1e-12)
    # step 1 samples from the reference itself (KL 0 < target: beta shrinks), later steps drift (beta grows);
    # without the restored coefficient, step 3 (after the resume) would start again from 0.05
    assert train[1]["kl_coef"] < train[0]["kl_coef"] < train[2]["kl_coef"] or train[2]["kl_coef"] != 0.05


def test_kl_controller_settings_are_checked(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.ppo import run_ppo

    with pytest.raises(ValueError, match="set kl_coef > 0 as the starting coefficient"):
        run_ppo(_ppo(assets, tmp_path / "a", kl_coef=0.0))
    with pytest.raises(ValueError, match="set the \\(initial\\) coefficient with kl_coef only"):
        run_ppo(_ppo(assets, tmp_path / "b", **{"kl_ctrl.kl_coef": 0.3}))
    with pytest.raises(ValueError, match="unknown kl_ctrl type 'pid'"):
        _ppo(assets, tmp_path / "c", **{"kl_ctrl.type": "pid"})


def _grpo_kl(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    base = {
        "advantage": "grpo", "reward_fn": f"{__name__}:_length_reward", "steps": 3, "save_every": 1,
        "actor.kl_coef": 0.5, "actor.kl_estimator": "k3", "rollout_correction.mode": "none",
        "engine.optimizer.lr": 3e-2, "temperature": 1.0,
    }  # fmt: skip
    return _grpo(assets, out, **(base | overrides))


def test_grpo_kl_loss_term_against_the_reference(assets: dict[str, Any], tmp_path: Path) -> None:
    """actor.kl_coef > 0 builds the frozen reference; the step's loss is pg_loss + beta * KL_k3 (token means),
    0 KL while the policy is still the reference, > 0 once it has moved."""
    from shardforge.algorithms.trainers.grpo import run_grpo

    run_grpo(_grpo_kl(assets, tmp_path / "o"))
    train = [r for r in (json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines())]
    train = [r for r in train if r["split"] == "train"]
    assert abs(train[0]["actor/kl_ref"]) < 1e-6 and train[2]["actor/kl_ref"] > 1e-4, train
    for r in train:
        assert r["kl_coef"] == 0.5
        assert r["loss"] == pytest.approx(r["actor/pg_loss"] + 0.5 * r["actor/kl_ref"], rel=1e-5, abs=1e-7)


def test_grpo_adaptive_kl_coefficient_follows_the_controller_and_survives_resume(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    out, ctrl = tmp_path / "o", {"kl_ctrl.type": "adaptive", "kl_ctrl.target_kl": 1e-4, "kl_ctrl.horizon": 20}
    run_grpo(_grpo_kl(assets, out, steps=2, **ctrl))
    run_grpo(_grpo_kl(assets, out, steps=3, **ctrl))  # resumes from step 2's checkpoint
    train = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())]
    train = [r for r in train if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and train[0]["kl_coef"] == 0.5
    for before, after in itertools.pairwise(train):  # n = prompts_per_step x group_size = 12 samples per step
        expected = _adaptive(before["kl_coef"], before["actor/kl_ref"], n=12)
        assert after["kl_coef"] == pytest.approx(expected, rel=1e-12)
    assert train[2]["kl_coef"] != 0.5  # the restored coefficient, not the configured start


def test_grpo_kl_controller_settings_are_checked(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    with pytest.raises(ValueError, match=r"steers actor\.kl_coef, which is 0"):
        run_grpo(_grpo_kl(assets, tmp_path / "a", **{"actor.kl_coef": 0.0, "kl_ctrl.type": "adaptive"}))
    with pytest.raises(ValueError, match=r"set the \(initial\) coefficient with actor\.kl_coef only"):
        run_grpo(_grpo_kl(assets, tmp_path / "b", **{"kl_ctrl.kl_coef": 0.3}))
