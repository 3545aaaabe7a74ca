"""GRPO pieces: rollouts -> packed batch, reward functions and their errors, the embedded HF
rollout engine (behaviour log-probs, weight versions), config validation, and resume."""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.algorithms.data.prompts import load_prompts
from shardforge.algorithms.testing.reference import rollouts_to_batch, score_rollouts
from shardforge.engine.objectives.advantages import group_advantages
from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS
from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
from shardforge.rewards import exact_match_reward, load_reward_fn
from shardforge.rollout import Rollout, SamplingParams

REWARD_MODULE = textwrap.dedent(
    """
    def has_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)

    def raises(prompt, response, reference):
        raise KeyError("boom")

    def nan(prompt, response, reference):
        return float("nan")
    """
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("grpo")
    _tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=16, data_seed=2)
    tokenizer, train, evaluation = _tiny["tokenizer"], _tiny["train"], _tiny["eval"]
    (root / "rewards_mod.py").write_text(REWARD_MODULE)
    sys.path.insert(0, str(root))
    return {"root": root, "tokenizer": tokenizer, "model": str(root / "model"), "train": train, "eval": evaluation}


def _rollout(i: int, prompt: list[int], response: list[int]) -> Rollout:
    logprobs = [-0.1 * (k + 1) for k in range(len(response))]
    return Rollout(
        prompt_index=i, prompt_ids=prompt, response_ids=response, logprobs=logprobs, finished=True, version=3
    )


def test_rollouts_to_batch_aligns_targets_advantages_and_logprobs() -> None:
    rollouts = [_rollout(0, [1, 5, 6], [7, 2]), _rollout(0, [1, 5, 6], [9, 9, 2]), _rollout(1, [1, 4], [2])]
    batch = rollouts_to_batch(rollouts, torch.tensor([0.5, -0.5, 2.0]))
    assert batch.input_ids.tolist() == [1, 5, 6, 7, 2, 1, 5, 6, 9, 9, 2, 1, 4, 2]
    assert batch.cu_seqlens.tolist() == [0, 5, 11, 14]
    assert batch.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1]
    assert batch.extras[ADVANTAGES].tolist() == [0, 0, 0, 0.5, 0.5, 0, 0, 0, -0.5, -0.5, -0.5, 0, 0, 2.0]
    expected = [0, 0, 0, -0.1, -0.2, 0, 0, 0, -0.1, -0.2, -0.3, 0, 0, -0.1]
    assert torch.allclose(batch.extras[OLD_LOGPROBS], torch.tensor(expected))
    assert torch.equal(batch.extras[OLD_LOGPROBS], batch.extras[BEHAVIOUR_LOGPROBS])
    with pytest.raises(ValueError, match="3 rollouts but 2 advantages"):
        rollouts_to_batch(rollouts, torch.zeros(2))


def test_group_advantages_estimators_and_errors() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    grpo = group_advantages(rewards, 3, "grpo")
    assert bool(torch.isfinite(grpo).all()) and grpo[0] > 0 > grpo[1] and grpo[4] > 0 > grpo[3]
    assert torch.allclose(group_advantages(rewards, 3, "dr_grpo")[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    assert torch.equal(group_advantages(torch.ones(4), 2, "grpo"), torch.zeros(4)), "zero-std groups get 0"
    with pytest.raises(
        ValueError, match=r"unknown advantage estimator 'ppo'; registered: \[.*'dr_grpo', .*'grpo', .*'rloo'"
    ):
        group_advantages(rewards, 3, "ppo")  # type: ignore[arg-type]


def test_reward_functions_and_their_errors(assets: dict[str, Any]) -> None:
    assert exact_match_reward("1+1=", " 2 ", "2") == 1.0
    assert exact_match_reward("", "2.0", "2") == 1.0
    assert exact_match_reward("", "4 or 2", "2") == 0.0
    assert load_reward_fn("exact_match") is exact_match_reward
    fn = load_reward_fn("rewards_mod:has_seven")
    rollouts = [_rollout(0, [1], [2]), _rollout(1, [1], [2])]
    rollouts = [dataclasses.replace(r, text=t) for r, t in zip(rollouts, ["7", "ab"])]
    with pytest.raises(ValueError, match="cannot import module"):
        load_reward_fn("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no callable"):
        load_reward_fn("rewards_mod:missing")
    with pytest.raises(RuntimeError, match=r"reward function raised on prompt 'p0'.*KeyError"):
        score_rollouts(rollouts, ["p0", "p1"], ["a", "b"], load_reward_fn("rewards_mod:raises"))
    with pytest.raises(ValueError, match="returned nan for prompt 'p0'"):
        score_rollouts(rollouts, ["p0", "p1"], ["a", "b"], load_reward_fn("rewards_mod.nan"))
    scores = score_rollouts(rollouts, ["p0", "p1"], ["a", "b"], fn)
    assert scores.dtype == torch.float32 and scores.shape == (2,)


def test_sampling_params_validation() -> None:
    for bad, match in [({"n": 0}, "n=0"), ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temp")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


def test_hf_rollout_engine_logprobs_versions_and_determinism(assets: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from shardforge.rollout import HFRolloutEngine
    from shardforge.weight_sync import DiskTransport, WeightPublisher

    tokenizer = assets["tokenizer"]
    prompts = load_prompts(assets["eval"], tokenizer)
    engine = HFRolloutEngine(assets["model"], tokenizer, weights_root=tmp_path / "w")
    params = SamplingParams(n=3, max_new_tokens=5, temperature=0.9, seed=5)
    first = engine.generate(prompts.ids[:4], params)
    again = engine.generate(prompts.ids[:4], params)
    assert len(first) == 12 and [r.prompt_index for r in first] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [r.response_ids for r in first] == [r.response_ids for r in again], "a seed fixes the samples"
    # Behaviour log-probs equal a teacher-forced recomputation at the same temperature.
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    for r in first[:5]:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1] / 0.9
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-4), (r.logprobs, want)
        assert r.finished == (r.response_ids[-1] == tokenizer.eos_token_id) and len(r.response_ids) <= 5
    # A published version is served after update_weights; generations change with the weights.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    WeightPublisher(model, DiskTransport(tmp_path / "w"), bucket_bytes=1 << 16).publish(1)
    assert engine.update_weights() == 1 and all(r.version == 0 for r in first)
    after = engine.generate(prompts.ids[:4], params)
    assert all(r.version == 1 for r in after)
    assert [r.response_ids for r in after] != [r.response_ids for r in first]
    state = engine.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def _config(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "eval_file": str(assets["eval"]),
        "output_dir": str(out), "layout": "d1", "steps": 4, "prompts_per_step": 4, "group_size": 4,
        "max_new_tokens": 4, "reward_fn": "rewards_mod:has_seven", "progress": False, "save_every": 2,
        "eval_size": 8, "export_hf_at_end": False,
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    return build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _train_records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_grpo_resume_mid_run_reproduces_the_next_steps(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    straight = run_grpo(_config(assets, tmp_path / "a"))
    run_grpo(_config(assets, tmp_path / "b", steps=2))
    resumed = run_grpo(_config(assets, tmp_path / "b"))  # continues from the step-2 checkpoint
    a, b = _train_records(tmp_path / "a"), _train_records(tmp_path / "b")
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "reward_mean", "response_len_mean"):
        assert [r[key] for r in a[2:]] == [r[key] for r in b[-2:]], key
    assert any(r["reward_std"] > 0 for r in a), "the test reward varies, so the steps carry a signal"
    assert straight["reward_mean"] == resumed["reward_mean"]


def test_grpo_config_errors(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    with pytest.raises(ValueError, match="group_size >= 2"):
        run_grpo(_config(assets, tmp_path / "c", group_size=1))
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=8"):
        run_grpo(_config(assets, tmp_path / "d", **{"engine.max_tokens_per_microbatch": 8}))
    with pytest.raises(RuntimeError, match="reward function raised"):
        run_grpo(
            _config(assets, tmp_path / "e", reward_fn="rewards_mod:raises", steps=1, **{"reward.on_error": "raise"})
        )
    with pytest.warns(UserWarning, match="skipped .* longer than 5 tokens"):
        prompts = load_prompts(assets["eval"], assets["tokenizer"], max_prompt_len=5)
    assert all(len(p) <= 5 for p in prompts.ids)
    # Prompts are tokenised in one batched call: each kept prompt still has exactly its own ids.
    tok = assets["tokenizer"]
    prefix = [tok.bos_token_id] if tok.bos_token_id is not None else []
    for kept in (prompts, load_prompts(assets["eval"], tok)):
        assert kept.ids == [prefix + tok(text, add_special_tokens=False)["input_ids"] for text in kept.texts]


def test_trainer_log_probs_use_the_rollout_temperature(assets: dict[str, Any], tmp_path: Path) -> None:
    """At temperature 0.7 the trainer's recomputed log-probs equal the rollout engine's
    behaviour log-probs (both softmax(logits / 0.7)): the PPO ratio compares one distribution."""
    from shardforge.algorithms.trainers.grpo import run_grpo

    out = tmp_path / "t07"
    run_grpo(_config(assets, out, temperature=0.7, steps=1, save_every=0, resume="never"))
    [record] = _train_records(out)
    assert record["behaviour_kl"] < 1e-4, record["behaviour_kl"]


def test_grpo_with_lora_serves_the_merged_weights(assets: dict[str, Any], tmp_path: Path) -> None:
    # The rollout engine loads what publish_weights sends: with LoRA that must be base + scale * B @ A.
    # If the adapters were left out, the trainer (with adapters) and the rollout engine (base only) would
    # disagree on the log-probs of the samples from step 2 on (B is zero only before the first update).
    from shardforge.algorithms.trainers.grpo import run_grpo

    overrides = {
        "engine.lora.r": "4", "engine.lora.target_modules": "[q_proj,v_proj,down_proj]",
        "engine.optimizer.lr": "5e-2", "steps": 3, "save_every": 0, "resume": "never",
    }  # fmt: skip
    run_grpo(_config(assets, tmp_path / "lora", **overrides))
    records = _train_records(tmp_path / "lora")
    assert [r["rollout_version"] for r in records] == [1.0, 2.0, 3.0]
    for record in records:
        assert record["behaviour_kl"] < 1e-4, record
    assert records[-1]["grad_norm"] > 0


def test_grpo_config_refuses_an_unknown_advantage_estimator_when_built(tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    base = {"model": "m", "train_file": "t.jsonl", "output_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grop'; registered: \[.*'grpo'"):
        build_config(GRPOConfig, {**base, "advantage": "grop"})
    with pytest.raises(ValueError, match="needs a critic"):
        build_config(GRPOConfig, {**base, "advantage": "gae"})
    assert build_config(GRPOConfig, {**base, "advantage": "reinforce_plus_plus"}).advantage == "reinforce_plus_plus"
    assert build_config(GRPOConfig, {**base, "advantage": "my_pkg.adv:fn"}).advantage == "my_pkg.adv:fn"
