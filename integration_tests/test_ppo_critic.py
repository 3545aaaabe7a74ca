"""PPO with a critic: a few actor + critic steps on the same fixed rollouts give the same actor and
critic losses, statistics and weights under world 1, FSDP 2 and FSDP 2 x TP 2.

Each step runs the whole update: old log-probs (actor forward), values (critic forward, shifted to
target alignment), KL-in-reward against a forward-only reference engine, GAE, global advantage
whitening, then two actor and two critic optimizer steps (PPO epochs). Each data-parallel rank holds half of
the rollouts; whitening, explained variance and the loss normalisation are global.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

STEPS = 2
NUM_ROLLOUTS = 12
# fp32 on CPU, different reduction order under FSDP (reduce-scatter): rounding-level differences.
# Adam's eps=1e-6 keeps rounding in tiny gradient entries from being amplified into the update
# (see integration_tests/test_rl_layouts.py).
LOSS_TOL = 1e-5
WEIGHT_TOL = 2e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("ppo_critic")
    tiny_assets(root, seed=31, data=False)
    return str(root / "model")


def _rollouts() -> tuple[Any, torch.Tensor]:
    from shardforge.algorithms.rlvr import rollouts_to_batch
    from shardforge.algorithms.rollout import Rollout

    gen = torch.Generator().manual_seed(0)
    rollouts = []
    for i in range(NUM_ROLLOUTS):
        prompt = [1, *torch.randint(4, 20, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()]
        response = torch.randint(4, 20, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
        rollouts.append(Rollout(prompt_index=i, prompt_ids=prompt, response_ids=response,
                                logprobs=[0.0] * len(response), finished=False, version=0))  # fmt: skip
    rewards = torch.randn(NUM_ROLLOUTS, generator=gen)
    return rollouts_to_batch(rollouts, torch.zeros(NUM_ROLLOUTS)), rewards


def _train(model_dir: str, layout: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms import EngineConfig, OptimizerConfig, TrainEngine
    from shardforge.algorithms.objectives import PPOActorConfig, PPOActorLossFn, PPOCriticConfig
    from shardforge.algorithms.trainers.ppo_update import ShiftedCriticLossFn, ppo_update, prepare_ppo_batch

    def config(head: str, lr: float) -> EngineConfig:
        return EngineConfig(head=head, max_tokens_per_microbatch=24, optimizer=OptimizerConfig(lr=lr, eps=1e-6))  # type: ignore[arg-type]

    actor = TrainEngine(model_dir, layout, config("lm", 1e-2))
    critic = TrainEngine(model_dir, layout, config("value", 2e-2))
    reference = TrainEngine(model_dir, layout, config("lm", 0.0))
    batch, rewards = _rollouts()
    mine = list(range(NUM_ROLLOUTS))[actor.dp_rank :: actor.dp_size]
    local, local_rewards = batch.select(mine), rewards[mine]
    actor_fn = PPOActorLossFn(PPOActorConfig(clip_eps_low=0.2, entropy_coef=0.01))
    critic_fn = ShiftedCriticLossFn(PPOCriticConfig(value_clip=0.1))
    history = []
    for _ in range(STEPS):
        stats = prepare_ppo_batch(local, local_rewards, actor, critic, reference, gamma=1.0, lam=0.9, kl_coef=0.1)
        stats |= ppo_update(local, actor, critic, actor_fn, critic_fn, epochs=2)
        history.append(stats)
    actor_weights, critic_weights = actor.full_state_dict(), critic.full_state_dict()
    main = not dist.is_initialized() or dist.get_rank() == 0
    return {"history": history, "actor": actor_weights, "critic": critic_weights} if main else {}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[str, float]:
    assert a.keys() == b.keys()
    diffs = {k: float((a[k] - v).abs().max()) for k, v in b.items()}
    worst = max(diffs, key=diffs.__getitem__)
    return worst, diffs[worst]


def test_ppo_actor_critic_steps_match_across_layouts(model_dir: str) -> None:
    single = _train(model_dir, "d1")
    first, second = single["history"]
    assert abs(first["kl_ref"]) <= 1e-7 < abs(second["kl_ref"]), "the actor starts at the reference, then moves"
    # Two optimizer steps per batch: the second acts on moved ratios and values, so both clip.
    assert second["critic/value_clip_frac"] > 0 and second["actor/clip_frac"] > 0, "the data exercises clipping"
    keys = ("loss", "critic/loss", "grad_norm", "critic/grad_norm", "explained_variance", "kl_ref",
            "advantage_std", "actor/clip_frac", "actor/approx_kl", "critic/value_clip_frac", "actor/num_tokens")  # fmt: skip
    for world, layout in ((2, "d2"), (4, "d2t2")):
        sharded = get_rank_pool(world).run(_train, model_dir, layout, timeout_s=300)[0]
        for step, (a, b) in enumerate(zip(single["history"], sharded["history"], strict=True)):
            for key in keys:
                assert abs(a[key] - b[key]) <= LOSS_TOL * max(1.0, abs(a[key])), (layout, step, key, a[key], b[key])
        for name in ("actor", "critic"):
            worst, diff = _max_diff(single[name], sharded[name])
            assert diff <= WEIGHT_TOL, (layout, name, worst, diff)
    initial = _initial(model_dir)
    moved = max(float((single["actor"][k] - v).abs().max()) for k, v in initial.items())
    assert moved > 1e-3, "the steps changed the actor"


def _initial(model_dir: str) -> dict[str, torch.Tensor]:
    from pathlib import Path

    from safetensors.torch import load_file

    return load_file(str(next(Path(model_dir).glob("*.safetensors"))))
