"""PPO through workflows (world 1): rlvr through the workflow samples exactly what the plain
rollout path sampled; multi_turn / tool_use end to end from config; tool/user tokens get no value
target, no advantage and no loss; rollout correction and dynamic sampling in PPO."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

USER_MODULE = textwrap.dedent(
    """
    def has_digit(prompt, response, reference):
        return float(any(c.isdigit() for c in response))

    def first_digit_even(prompt, response, reference):
        digits = [c for c in response if c.isdigit()]
        return float(bool(digits) and int(digits[0]) % 2 == 0)
    """
)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_chat_assets

    root = tmp_path_factory.mktemp("ppo_chat")
    (root / "ppo_wf_mod.py").write_text(USER_MODULE)
    sys.path.insert(0, str(root))
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=?", "completion": str(2 * a)}) + "\n" for a in range(8)))
    return tiny_chat_assets(root, seed=3) | {"data": data}


def _config(chat: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.ppo import PPOConfig

    base = {
        "model": chat["model"], "train_file": str(chat["data"]), "output_dir": str(out), "layout": "d1",
        "steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "progress": False,
        "export_hf_at_end": False, "temperature": 0.9, "reward_fn": "ppo_wf_mod:has_digit", "resume": "never",
        "update_epochs": 1,
        "workflow": {"name": "multi_turn", "max_turns": 3, "chat_template": True, "multi_turn": {"turn_discount": 0.5}},
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 3e-3}},
        "critic_engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 1e-2}},
    }  # fmt: skip
    return build_config(PPOConfig, apply_overrides(base, [f"{k}={v}" for k, v in overrides.items()]))


def _records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_rlvr_workflow_samples_what_the_plain_rollout_path_sampled(chat: dict[str, Any], tmp_path: Path) -> None:
    """PPO used to call ``rollout.generate(prompts, n=group_size, seed)`` + ``rollouts_to_batch``; the
    rlvr workflow must give the same packed batch, behaviour log-probs and rewards (so the same steps)."""
    from shardforge.algorithms.data import GlobalBatchSampler
    from shardforge.algorithms.data.prompts import load_prompts
    from shardforge.algorithms.testing.reference import rollouts_to_batch, score_rollouts
    from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
    from shardforge.algorithms.trainers.rl.sampling import build_rl_workflow, workflow_round_fn
    from shardforge.rewards import load_reward_fn
    from shardforge.rollout import HFRolloutEngine, SamplingParams
    from shardforge.rollout.seeds import request_seed

    config = _config(chat, tmp_path, **{"workflow.name": "rlvr", "workflow.chat_template": "false", "group_size": 3})
    tokenizer = chat["tokenizer"]
    prompts = load_prompts(config.train_file, tokenizer)
    reward_fn = load_reward_fn(config.reward_fn)
    rollout = HFRolloutEngine(config.model, tokenizer, weights_root=tmp_path / "w")
    workflow = build_rl_workflow(config, tokenizer, reward_fn, 256)
    for dp_rank, dp_size in ((0, 1), (1, 2)):
        engine = SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size)
        step = 1
        trajectories, rewards = workflow_round_fn(config, rollout, prompts, workflow, engine)(step, 0)  # type: ignore[arg-type]
        # Today's PPO path before workflows (kept here as the reference):
        indices = GlobalBatchSampler(len(prompts), config.prompts_per_step, seed=config.seed).local_batch(
            step, dp_rank, dp_size
        )
        # Each prompt's seed: of its position in the step's global batch (rank dp_rank holds every dp_size-th).
        seed = (config.seed * 1_000_003 + step) * 1_009
        positions = range(dp_rank, config.prompts_per_step, dp_size)
        seeds = tuple(request_seed(seed, p, config.group_size) for p in positions)
        params = SamplingParams(n=3, max_new_tokens=4, temperature=0.9, seeds=seeds)
        rollouts = rollout.generate([prompts.ids[i] for i in indices], params)
        want_rewards = score_rollouts(
            rollouts, [prompts.texts[i] for i in indices], [prompts.references[i] for i in indices], reward_fn
        )
        want = rollouts_to_batch(rollouts, torch.zeros(len(rollouts)))
        got = trajectories_to_batch(trajectories, torch.zeros(len(trajectories)))
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.cu_seqlens, want.cu_seqlens)
        assert torch.equal(got.loss_mask, want.loss_mask) and torch.equal(got.position_ids, want.position_ids)
        for key, value in want.extras.items():
            assert torch.equal(got.extras[key], value), key
        assert torch.equal(rewards.float(), want_rewards.float())


def test_ppo_multi_turn_masks_environment_tokens_and_logs_episodes(chat: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.ppo import run_ppo

    run_ppo(_config(chat, tmp_path / "a", **{"rollout_correction.mode": "icepop"}))
    records = _records(tmp_path / "a")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["episode/turns"] > 1 and r["episodes_failed"] == 0, r
        assert r["behaviour_kl"] < 1e-4, "recomputed log-probs match the engine's on every turn"
        for key in ("loss", "grad_norm", "critic/loss", "explained_variance", "rollout_corr/kl_k3"):
            assert math.isfinite(r[key]), key
        assert r["rollout_corr/masked_frac"] == 0.0, "no mismatch on CPU fp32: IcePop masks nothing"
    assert records[-1]["grad_norm"] > 0 and records[-1]["critic/grad_norm"] > 0


def test_ppo_tool_use_from_config(chat: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.ppo import run_ppo

    overrides = {"workflow.name": "tool_use", "workflow.max_turns": 2, "steps": 1, "max_new_tokens": 6}
    run_ppo(_config(chat, tmp_path / "t", **overrides))
    [record] = _records(tmp_path / "t")
    assert record["episodes_failed"] == 0 and math.isfinite(record["loss"]) and math.isfinite(record["critic/loss"])
    assert "episode/tool_calls" in record and record["behaviour_kl"] < 1e-4


def test_gae_values_and_losses_only_on_generated_tokens(chat: dict[str, Any]) -> None:
    """A multi-turn trajectory: prepare_ppo_batch's advantages/returns/values are 0 on environment
    tokens, equal GAE over the generated tokens alone (changing the environment tokens' critic
    values changes nothing), and the actor's / critic's losses do not see environment tokens."""
    from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
    from shardforge.algorithms.trainers.rl.ppo_update import ShiftedCriticLossFn, prepare_ppo_batch
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.objectives import PPOActorConfig, PPOActorLossFn, PPOCriticConfig, gae_advantages
    from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_VALUES, RETURNS
    from shardforge.rollout.episodes.trajectory import Trajectory

    def traj(ids: list[int], mask: list[int]) -> Trajectory:
        return Trajectory(group=0, token_ids=ids, loss_mask=mask, logprobs=[-1.0 * m for m in mask],
                          versions=[0 if m else -1 for m in mask])  # fmt: skip

    #            prompt    gen    tool   gen
    a = traj([1, 5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 1, 1, 0, 0, 1, 1, 1])
    b = traj([1, 4, 4, 20, 21, 22], [0, 0, 1, 0, 1, 1])
    batch = trajectories_to_batch([a, b], torch.zeros(2))
    actor = TrainEngine(chat["model"], "d1")
    critic = TrainEngine(chat["model"], "d1", EngineConfig(head="value"))
    rewards = torch.tensor([1.0, -0.5])
    prepare_ppo_batch(batch, rewards, actor, critic, None, gamma=0.9, lam=0.8, whiten_advantages=False)
    env = batch.loss_mask == 0
    for key in (ADVANTAGES, RETURNS, OLD_VALUES):
        assert torch.all(batch.extras[key][env] == 0), key
    # Recompute GAE on the generated tokens only, as if the environment tokens were not there.
    mask = batch.loss_mask != 0
    seqlens = [int(mask[s:e].sum()) for s, e in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:])]
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()])
    compact_values = batch.extras[OLD_VALUES][mask]
    compact_rewards = torch.zeros(int(mask.sum()))
    compact_rewards[cu[1:] - 1] = rewards
    want, _ = gae_advantages(compact_rewards, compact_values, torch.ones_like(compact_values), cu, gamma=0.9, lam=0.8)
    torch.testing.assert_close(batch.extras[ADVANTAGES][mask], want)
    # Losses: perturbing environment-token inputs of the loss changes nothing.
    actor_fn, critic_fn = PPOActorLossFn(PPOActorConfig()), ShiftedCriticLossFn(PPOCriticConfig())
    logprobs, values = torch.randn(batch.num_tokens), torch.randn(batch.num_tokens)
    before = (float(actor_fn(logprobs, batch)), float(critic_fn(values, batch)))
    noisy = logprobs + env.float() * 5.0
    # The critic's values are shifted by one (value of the state before token t): perturb at t+1.
    shifted_env = torch.cat([env[1:], env[:1]])
    after = (float(actor_fn(noisy, batch)), float(critic_fn(values + shifted_env.float() * 5.0, batch)))
    assert before == after


@pytest.mark.parametrize("mode", ["none", "token_tis", "token_mis", "seq_tis"])
def test_rollout_correction_weights_the_ppo_actor_loss_as_the_reference(chat: dict[str, Any], mode: str) -> None:
    """A known mismatch (behaviour = old - noise): the actor's loss equals the float64 reference
    -sum(A_t w_t) / kept tokens (at ratio 1, no clipping), w from the formula written here; the
    critic's batch keeps every generated token; the metrics are reported."""
    from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
    from shardforge.algorithms.trainers.rl.metrics import StepMetrics
    from shardforge.algorithms.trainers.rl.ppo_update import correct_actor_batch, prepare_ppo_batch
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.objectives import PPOActorConfig, PPOActorLossFn, RolloutCorrectionConfig
    from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS
    from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
    from shardforge.rollout.episodes.trajectory import Trajectory

    gen = torch.Generator().manual_seed(0)
    trajectories = []
    for _ in range(4):
        n = int(torch.randint(4, 8, (1,), generator=gen))
        mask = [0, 0] + [int(m) for m in torch.randint(0, 2, (n,), generator=gen)] + [1]
        ids = torch.randint(4, 30, (len(mask),), generator=gen).tolist()
        trajectories.append(Trajectory(group=0, token_ids=ids, loss_mask=mask, logprobs=[0.0] * len(mask),
                                       versions=[0] * len(mask)))  # fmt: skip
    batch = trajectories_to_batch(trajectories, torch.zeros(4))
    actor = TrainEngine(chat["model"], "d1")
    critic = TrainEngine(chat["model"], "d1", EngineConfig(head="value"))
    prepare_ppo_batch(batch, torch.tensor([1.0, 0.0, 0.5, -1.0]), actor, critic, None, whiten_advantages=False)
    mask = batch.loss_mask != 0
    old = batch.extras[OLD_LOGPROBS].double()
    noise = torch.randn(batch.num_tokens, generator=gen, dtype=torch.float64) * 0.8
    batch.extras[BEHAVIOUR_LOGPROBS] = ((old - noise) * mask).float()
    config = RolloutCorrectionConfig(mode=mode, cap=1.5, low=0.5, high=1.5)
    metrics = StepMetrics()
    actor_batch = correct_actor_batch(batch, config, actor, metrics)
    stats = metrics.reduce(actor.dp_group, actor.device)
    # Reference weights from the formulas (docs/packages/algorithms-rollout-correction.md).
    log_rho = (old - batch.extras[BEHAVIOUR_LOGPROBS].double()) * mask
    if mode == "none":
        w, keep = torch.ones_like(old), mask
    elif mode == "token_tis":
        w, keep = log_rho.exp().clamp(max=1.5), mask
    elif mode == "token_mis":
        w = log_rho.exp()
        keep = mask & (w >= 0.5) & (w <= 1.5)
    else:  # seq_tis: the product over the sequence, truncated, on each of its tokens
        w = torch.zeros_like(old)
        for s, e in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
            w[s:e] = log_rho[s:e].sum().exp().clamp(max=1.5)
        keep = mask
    adv = batch.extras[ADVANTAGES].double()
    want = float(-(adv * w)[keep].sum() / keep.sum())
    actor_fn = PPOActorLossFn(PPOActorConfig())
    # The loss function returns the sum; the engine divides by the global loss weight (kept tokens).
    got = float(actor_fn(batch.extras[OLD_LOGPROBS], actor_batch)) / float(actor_fn.loss_weight(actor_batch))
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (mode, got, want)
    assert torch.equal(batch.loss_mask != 0, mask), "the critic's batch keeps every generated token"
    assert torch.equal(actor_batch.loss_mask != 0, keep)
    assert stats["behaviour_kl"] == pytest.approx(float(noise[mask].abs().mean()), rel=1e-5)
    assert stats["rollout_corr/kl_k1"] == pytest.approx(float(-log_rho[mask].mean()), rel=1e-5, abs=1e-7)
    if mode == "token_tis":
        assert stats["rollout_corr/truncated_frac"] == pytest.approx(float((log_rho.exp() > 1.5)[mask].double().mean()))
    if mode == "token_mis":
        assert stats["rollout_corr/masked_frac"] == pytest.approx(1 - float(keep.sum() / mask.sum()))
        assert 0 < stats["rollout_corr/masked_frac"] < 1
    if mode != "none":  # the correction really changes the loss
        plain = float(-(adv[mask]).sum() / mask.sum())
        assert abs(got - plain) > 1e-4


def test_ppo_config_refuses_what_it_cannot_do(chat: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.ppo import run_ppo

    with pytest.raises(ValueError, match="recompute_logprobs=false leaves no trainer log-probs"):
        run_ppo(_config(chat, tmp_path / "a", recompute_logprobs="false"))
    with pytest.raises(ValueError, match=r"dynamic_sampling .* needs group_size >= 2"):
        run_ppo(_config(chat, tmp_path / "b", group_size=1, **{"dynamic_sampling.enabled": "true"}))


def test_ppo_dynamic_sampling_keeps_groups_with_signal(chat: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.ppo import run_ppo

    overrides = {
        "workflow.name": "rlvr", "workflow.chat_template": "false", "reward_fn": "ppo_wf_mod:first_digit_even",
        "dynamic_sampling.enabled": "true", "dynamic_sampling.max_rounds": 4, "group_size": 3, "steps": 2,
    }  # fmt: skip
    run_ppo(_config(chat, tmp_path / "ds", **overrides))
    records = _records(tmp_path / "ds")
    for r in records:
        generated, kept = r["dynamic_sampling/groups_generated"], r["dynamic_sampling/groups_kept"]
        filtered = r["dynamic_sampling/filtered_all_pass"] + r["dynamic_sampling/filtered_all_fail"]
        assert generated == 2 * r["dynamic_sampling/rounds"], "every round draws prompts_per_step groups"
        assert kept <= 2 and (kept < 2) == bool(r["dynamic_sampling/cap_hit"]) and filtered <= generated - kept
        assert 0 < r["reward_mean"] < 1, "the step trains only on groups with reward variance"
    assert sum(r["dynamic_sampling/filtered_all_fail"] for r in records) > 0, "the data exercises filtering"
    assert any(r["dynamic_sampling/rounds"] > 1 for r in records), "and backfilling"
