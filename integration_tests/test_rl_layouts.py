"""GRPO/PPO actor steps on the same rollouts give the same losses, statistics and updates under
world 1, FSDP 2 and FSDP 2 x TP 2.

The rollouts are fixed data (random prompts/responses, rewards -> GRPO advantages, behaviour
log-probs = the initial policy's log-probs minus noise so the ratios start away from 1 and
some tokens clip). Each data-parallel rank trains on its share of the groups; the engine's
global normalisation makes the result independent of the split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool
from shardforge.mesh.testing.parity import assert_counts_match

STEPS = 2
GROUPS, GROUP_SIZE = 6, 4
# fp32 on CPU; sharded runs sum in a different order (FSDP reduce-scatter, TP partial matmuls).
# Adam divides by sqrt(v) + eps: for gradient entries near eps a rounding-level difference in
# the gradient becomes a visible difference in the update (with eps=1e-8 and lr=2e-2 one
# up_proj entry differed by 1.4e-4 while its gradients agreed to 1e-6 relative). eps=1e-6 keeps
# that amplification small; the gradient norm is compared directly as well.
LOSS_TOL = 1e-5
WEIGHT_TOL = 2e-5
BOUNDARY_TOKENS = 2  # see docs/testing.md


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("rl_layouts")
    tiny_assets(root, seed=21, data=False)
    return str(root / "model")


def _rollouts() -> tuple[list[Any], torch.Tensor]:
    from shardforge.rollout import Rollout

    gen = torch.Generator().manual_seed(0)
    rollouts = []
    for g in range(GROUPS):
        prompt = [1, *torch.randint(4, 20, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()]
        for _ in range(GROUP_SIZE):
            n = int(torch.randint(1, 6, (1,), generator=gen))
            response = torch.randint(4, 20, (n,), generator=gen).tolist()
            rollouts.append(Rollout(prompt_index=g, prompt_ids=prompt, response_ids=response, logprobs=[0.0] * n,
                                    finished=False, version=0))  # fmt: skip
    rewards = torch.randint(0, 2, (len(rollouts),), generator=gen).float()
    return rollouts, rewards


def _batch(old_logprobs: torch.Tensor | None) -> Any:
    from shardforge.algorithms.testing.reference import rollouts_to_batch
    from shardforge.engine.objectives.advantages import group_advantages
    from shardforge.engine.objectives.loss_fns import OLD_LOGPROBS

    rollouts, rewards = _rollouts()
    batch = rollouts_to_batch(rollouts, group_advantages(rewards, GROUP_SIZE, "grpo"))
    if old_logprobs is not None:
        batch.extras[OLD_LOGPROBS] = old_logprobs
    return batch


def _multi_turn_batch(old_logprobs: torch.Tensor | None) -> Any:
    """Fixed multi-turn trajectories: prompt, then 1-3 (generated, environment) segments per episode;
    environment tokens (tool results / user turns) have loss mask 0: no advantage, no loss."""
    from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
    from shardforge.engine.objectives.advantages import group_advantages
    from shardforge.engine.objectives.loss_fns import OLD_LOGPROBS
    from shardforge.rollout.episodes.trajectory import Trajectory

    gen = torch.Generator().manual_seed(3)
    trajectories = []
    for g in range(GROUPS):
        prompt = [1, *torch.randint(4, 20, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen).tolist()]
        for _ in range(GROUP_SIZE):
            t = Trajectory(group=g, token_ids=list(prompt), loss_mask=[0] * len(prompt), logprobs=[0.0] * len(prompt),
                           versions=[-1] * len(prompt))  # fmt: skip
            for turn in range(int(torch.randint(1, 4, (1,), generator=gen))):
                if turn:  # the environment's answer to the previous turn
                    t.append(
                        torch.randint(4, 20, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
                    )
                n = int(torch.randint(1, 4, (1,), generator=gen))
                t.append(torch.randint(4, 20, (n,), generator=gen).tolist(), logprobs=[0.0] * n, version=0)
            trajectories.append(t)
    rewards = torch.randint(0, 2, (len(trajectories),), generator=gen).float()
    batch = trajectories_to_batch(trajectories, group_advantages(rewards, GROUP_SIZE, "grpo"))
    if old_logprobs is not None:
        batch.extras[OLD_LOGPROBS] = old_logprobs
    return batch


def _actor() -> Any:
    from shardforge.engine.objectives import PPOActorConfig, PPOActorLossFn

    return PPOActorLossFn(PPOActorConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0, entropy_coef=0.01))


def _train(
    model_dir: str,
    layout: str,
    old_logprobs: torch.Tensor,
    correction: Any = None,
    behaviour: Any = None,
    multi_turn: bool = False,
) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine
    from shardforge.engine.objectives import all_reduce_stats, apply_rollout_correction, summarize_stats
    from shardforge.engine.objectives.loss_fns import OLD_LOGPROBS
    from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS

    engine = TrainEngine(
        model_dir, layout, EngineConfig(max_tokens_per_microbatch=24, optimizer=OptimizerConfig(lr=1e-2, eps=1e-6))
    )
    batch = _multi_turn_batch(old_logprobs) if multi_turn else _batch(old_logprobs)
    groups = list(range(GROUPS))[engine.dp_rank :: engine.dp_size]
    mine = batch.select([g * GROUP_SIZE + k for g in groups for k in range(GROUP_SIZE)])
    corrected: dict[str, float] = {}
    if correction is not None:  # the same tokens' behaviour log-probs, selected like the batch
        batch.extras[BEHAVIOUR_LOGPROBS] = behaviour
        mine = batch.select([g * GROUP_SIZE + k for g in groups for k in range(GROUP_SIZE)])
        corrected = apply_rollout_correction(
            mine, correction, old_key=OLD_LOGPROBS, group=engine.dp_group, device=engine.device
        )
    actor = _actor()
    history = []
    for _ in range(STEPS):
        stats = engine.train_batch(mine, actor, actor.loss_weight)
        actor_stats = summarize_stats(all_reduce_stats(actor.pop_stats(), engine.dp_group))
        history.append({"loss": stats["loss"], "grad_norm": stats["grad_norm"], **actor_stats})
    full = engine.full_state_dict()
    main = not dist.is_initialized() or dist.get_rank() == 0
    return {"history": history, "weights": full, "correction": corrected} if main else {}


def test_grpo_steps_match_across_layouts(model_dir: str) -> None:
    from shardforge.engine import TrainEngine

    reference_engine = TrainEngine(model_dir, "d1")
    batch = _batch(None)
    noise = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(1)) * 0.3
    old = (reference_engine.forward(batch) - noise.abs()) * batch.loss_mask  # ratios > 1: some clip high
    del reference_engine
    single = _train(model_dir, "d1", old)
    assert single["history"][0]["clip_frac"] > 0, "the data exercises clipping"
    assert single["history"][0]["entropy"] > 0.1, "the engine passed the per-token entropy"
    for world, layout in ((2, "d2"), (4, "d2t2")):
        sharded = get_rank_pool(world).run(_train, model_dir, layout, old, timeout_s=300)[0]
        for step, (a, b) in enumerate(zip(single["history"], sharded["history"])):
            assert abs(a["loss"] - b["loss"]) <= LOSS_TOL, (layout, step, a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (layout, step, a, b)
            assert a["num_tokens"] == b["num_tokens"], (layout, step, a, b)  # from the loss masks: exact
            for key in ("approx_kl", "ratio", "entropy", "pg_loss"):
                assert abs(a[key] - b[key]) <= 1e-5, (layout, step, key, a[key], b[key])
            # Clip fractions count tokens past ratio = 1 - eps_low / 1 + eps_high (and the dual
            # clip): a token within rounding distance of a threshold may change side under another
            # reduction order or CPU. Allow BOUNDARY_TOKENS; the continuous stats above must agree.
            for key in ("clip_frac", "clip_low_frac", "clip_high_frac", "dual_clip_frac"):
                assert_counts_match(
                    a[key], b[key], a["num_tokens"], boundary=BOUNDARY_TOKENS, context=(layout, step, key)
                )
        assert sharded["weights"].keys() == single["weights"].keys()
        diffs = {k: float((single["weights"][k] - v).abs().max()) for k, v in sharded["weights"].items()}
        worst = max(diffs, key=diffs.__getitem__)
        assert diffs[worst] <= WEIGHT_TOL, (layout, worst, diffs[worst], sorted(diffs.values())[-5:])
    moved = max(float((single["weights"][k] - v).abs().max()) for k, v in _initial(model_dir).items())
    assert moved > 1e-3, "the steps changed the weights"


def _initial(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(next(Path(model_dir).glob("*.safetensors"))))


def test_rollout_correction_world1_vs_fsdp2(model_dir: str) -> None:
    """IcePop with batch normalisation (a global mean over the dp group) on a known mismatch:
    the same masked tokens, weights, losses and updates under world 1 and FSDP 2."""
    from shardforge.engine import TrainEngine
    from shardforge.engine.objectives import RolloutCorrectionConfig

    reference_engine = TrainEngine(model_dir, "d1")
    batch = _batch(None)
    old = reference_engine.forward(batch) * batch.loss_mask
    del reference_engine
    noise = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(2))
    behaviour = (old + noise) * batch.loss_mask  # ratios exp(-noise): some outside [0.5, 5]
    config = RolloutCorrectionConfig(mode="icepop", batch_normalize=True)
    single = _train(model_dir, "d1", old, config, behaviour)
    corr = single["correction"]
    assert 0.05 < corr["rollout_corr/masked_frac"] < 0.8, corr
    assert corr["rollout_corr/weight"] == pytest.approx(1.0, rel=1e-6), "batch-normalised"
    sharded = get_rank_pool(2).run(_train, model_dir, "d2", old, config, behaviour, timeout_s=300)[0]
    for key, value in corr.items():
        assert sharded["correction"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for step, (a, b) in enumerate(zip(single["history"], sharded["history"], strict=True)):
        assert abs(a["loss"] - b["loss"]) <= LOSS_TOL, (step, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (step, a, b)
        assert a["num_tokens"] == b["num_tokens"], "the same tokens were masked"
    diffs = {k: float((single["weights"][k] - v).abs().max()) for k, v in sharded["weights"].items()}
    assert max(diffs.values()) <= WEIGHT_TOL


def _behaviour_kl_on_rank() -> float:
    import torch.distributed as dist

    from shardforge.engine.objectives.rollout_correction import behaviour_kl

    rank = dist.get_rank()
    # Rank 0: 3 target tokens with |gap| 1 (and an untargeted one); rank 1: one token with |gap| 3.
    old = torch.tensor([0.0, -1.0, -2.0, -3.0]) if rank == 0 else torch.tensor([0.0, -4.0])
    behaviour = torch.tensor([5.0, 0.0, -3.0, -2.0]) if rank == 0 else torch.tensor([0.0, -1.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0]) if rank == 0 else torch.tensor([0.0, 1.0])
    return behaviour_kl(old, behaviour, mask, group=dist.group.WORLD)


def test_behaviour_kl_is_the_global_token_mean_at_world_2() -> None:
    """GRPO/PPO's ``behaviour_kl`` is the mean over every rank's target tokens (6 / 4 = 1.5), not
    rank 0's mean (1.0) nor the mean of the ranks' means (2.0); the same on every rank."""
    results = get_rank_pool(2).run(_behaviour_kl_on_rank, timeout_s=120)
    assert results == [1.5, 1.5]


@pytest.mark.parametrize(
    ("world", "layout"),
    [(2, "d2"), pytest.param(4, "d2t2", marks=pytest.mark.heavy)],  # d2t2: CI budget
)
def test_grpo_multi_turn_steps_match_across_layouts(model_dir: str, world: int, layout: str) -> None:
    """GRPO steps on multi-turn trajectories (environment tokens between generated segments) give the
    same losses, statistics and updates under world 1 as under FSDP 2 and FSDP 2 x TP 2 (tolerances
    above). FSDP 2 x TP 2 is `heavy` (nox -s integration); CI's single-turn test covers that layout."""
    from shardforge.engine import TrainEngine

    reference_engine = TrainEngine(model_dir, "d1")
    batch = _multi_turn_batch(None)
    env = (batch.loss_mask == 0) & (batch.position_ids > 0)
    assert bool((env[1:] & (batch.loss_mask[:-1] != 0)).any()), "environment tokens follow generated ones"
    noise = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(4)) * 0.3
    old = (reference_engine.forward(batch) - noise.abs()) * batch.loss_mask
    del reference_engine
    single = _train(model_dir, "d1", old, multi_turn=True)
    assert single["history"][0]["clip_frac"] > 0, "the data exercises clipping"
    sharded = get_rank_pool(world).run(_train, model_dir, layout, old, None, None, True, timeout_s=300)[0]
    for step, (a, b) in enumerate(zip(single["history"], sharded["history"], strict=True)):
        assert abs(a["loss"] - b["loss"]) <= LOSS_TOL, (layout, step, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (layout, step, a, b)
        assert a["num_tokens"] == b["num_tokens"], (layout, step)  # from the loss masks: exact
        for key in ("approx_kl", "ratio", "pg_loss"):
            assert abs(a[key] - b[key]) <= 1e-5, (layout, step, key, a[key], b[key])
    diffs = {k: float((single["weights"][k] - v).abs().max()) for k, v in sharded["weights"].items()}
    assert max(diffs.values()) <= WEIGHT_TOL, (layout, max(diffs.values()))


def _grpo_step_on_rank(model_dir: str, layout: str, reuse: bool) -> dict[str, float]:
    """One `grpo._train_step` on this rank's share of fixed rollouts whose behaviour log-probs are noise
    (a large trainer/engine gap): old log-probs from the training forward (reuse) or a recompute pass."""
    import torch.distributed as dist

    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, _train_step
    from shardforge.algorithms.trainers.rl.advantages import GroupAdvantages
    from shardforge.algorithms.trainers.rl.metrics import StepMetrics
    from shardforge.algorithms.trainers.rl.sources import SampledBatch
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine
    from shardforge.engine.objectives import PPOActorLossFn
    from shardforge.engine.objectives.on_policy import OnPolicyActorLossFn

    config = build_config(GRPOConfig, {
        "model": model_dir, "train_file": "unused.jsonl", "output_dir": "unused", "group_size": GROUP_SIZE,
        "prompts_per_step": GROUPS, "rollout_correction": {"mode": "token_tis"},
    })  # fmt: skip
    engine = TrainEngine(
        model_dir, layout, EngineConfig(max_tokens_per_microbatch=24, optimizer=OptimizerConfig(lr=1e-2, eps=1e-6))
    )
    from shardforge.rollout.episodes.trajectory import Trajectory

    rollouts, rewards = _rollouts()
    gen = torch.Generator().manual_seed(9)
    trajectories = []
    for r in rollouts:
        p, n = len(r.prompt_ids), len(r.response_ids)
        t = Trajectory(group=r.prompt_index, token_ids=list(r.prompt_ids), loss_mask=[0] * p, logprobs=[0.0] * p,
                       versions=[-1] * p)  # fmt: skip
        t.append(r.response_ids, logprobs=(-3.0 * torch.rand(n, generator=gen)).tolist(), version=0)
        trajectories.append(t)
    groups = list(range(GROUPS))[engine.dp_rank :: engine.dp_size]
    keep = [g * GROUP_SIZE + k for g in groups for k in range(GROUP_SIZE)]
    sampled = SampledBatch(index=0, policy_step=0, rollouts=[trajectories[i] for i in keep], rewards=rewards[keep])
    actor = OnPolicyActorLossFn(config.actor, config.rollout_correction) if reuse else PPOActorLossFn(config.actor)
    metrics = StepMetrics()
    stats = _train_step(sampled, config, engine, actor, metrics, GroupAdvantages(config.advantage, GROUP_SIZE))
    stats |= metrics.reduce(engine.dp_group, engine.device)
    keys = ("behaviour_kl", "loss", "grad_norm", "rollout_corr/kl_k3", "rollout_corr/truncated_frac")
    return {k: stats[k] for k in keys} if not dist.is_initialized() or dist.get_rank() == 0 else {}


def test_grpo_step_behaviour_kl_and_loss_match_across_layouts_with_and_without_the_recompute(model_dir: str) -> None:
    """The reuse-training-log-probs path reduces its in-loss correction statistics over dp like the recompute
    path: world 1 and FSDP 2 give the same behaviour_kl, k3 mismatch and loss, each path and across paths."""
    results = {
        (layout, reuse): (
            _grpo_step_on_rank(model_dir, layout, reuse)
            if layout == "d1"
            else get_rank_pool(2).run(_grpo_step_on_rank, model_dir, layout, reuse, timeout_s=300)[0]
        )
        for layout in ("d1", "d2")
        for reuse in (True, False)
    }
    reference = results[("d1", False)]
    assert reference["behaviour_kl"] > 0.5, reference  # the noise is a real gap
    for key, got in results.items():
        for name in ("behaviour_kl", "rollout_corr/kl_k3", "loss"):
            assert got[name] == pytest.approx(reference[name], rel=1e-5, abs=1e-7), (key, name, got, reference)
        assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), (key, got)
