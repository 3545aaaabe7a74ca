"""On-policy distillation parity: on fixed student rollouts, the teacher's per-token reverse-KL
advantages, the reverse-KL metric and two PPO updates of the student give world 1's numbers and
weights under FSDP 2 (student and teacher both sharded). Sampling itself is layout-dependent (each
rank draws its own share), so the rollouts are fixed here, as in test_rl_layouts.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

GROUPS, STEPS = 6, 2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("distill_layouts")
    student = tiny_assets(root / "s", seed=21, data=False)["model"]
    teacher = tiny_assets(root / "t", seed=5, data=False)["model"]
    model = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # a peaked teacher: large, varied advantages
    model.save_pretrained(teacher)
    return {"student": student, "teacher": teacher}


def _batch() -> Any:
    from shardforge.algorithms.testing.reference import rollouts_to_batch
    from shardforge.rollout import Rollout

    gen = torch.Generator().manual_seed(0)
    rollouts = []
    for g in range(GROUPS):
        prompt = [1, *torch.randint(4, 20, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()]
        n = int(torch.randint(1, 6, (1,), generator=gen))
        response = torch.randint(4, 20, (n,), generator=gen).tolist()
        logprobs = (-torch.rand(n, generator=gen) * 3).tolist()
        rollouts.append(Rollout(prompt_index=g, prompt_ids=prompt, response_ids=response, logprobs=logprobs,
                                finished=False, version=0))  # fmt: skip
    return rollouts_to_batch(rollouts, torch.zeros(len(rollouts)))


def _train(models: dict[str, str], layout: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms.trainers.distill import distill_advantages
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine
    from shardforge.engine.objectives import PPOActorConfig, PPOActorLossFn
    from shardforge.engine.objectives.loss_fns import ADVANTAGES
    from shardforge.mesh.collectives import all_reduce_sum

    config = EngineConfig(max_tokens_per_microbatch=24, optimizer=OptimizerConfig(lr=1e-2, eps=1e-6))
    student, teacher = TrainEngine(models["student"], layout, config), TrainEngine(models["teacher"], layout, config)
    batch = _batch()
    mine = batch.select(list(range(GROUPS))[student.dp_rank :: student.dp_size])
    advantages, reverse_kl = distill_advantages(mine, teacher.forward(mine), distill_coef=1.0, task_reward_coef=0.0)
    mine.extras[ADVANTAGES] = advantages
    kl_sum, count = all_reduce_sum(reverse_kl.double().sum(), mine.loss_mask.sum(), group=student.dp_group)
    actor = PPOActorLossFn(PPOActorConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    history = [student.train_batch(mine, actor, actor.loss_weight) for _ in range(STEPS)]
    full = student.full_state_dict()
    main = not dist.is_initialized() or dist.get_rank() == 0
    result = {"kl": kl_sum / count, "losses": [h["loss"] for h in history], "norms": [h["grad_norm"] for h in history]}
    return result | {"weights": full} if main else {}


def test_distill_step_matches_world1_under_fsdp2(models: dict[str, str]) -> None:
    single = _train(models, "d1")
    sharded = get_rank_pool(2).run(_train, models, "d2", timeout_s=300)[0]
    assert single["kl"] > 0.1  # the teacher disagrees with the behaviour log-probs: real advantages
    assert sharded["kl"] == pytest.approx(single["kl"], rel=1e-6)  # global token mean, not rank 0's
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(sharded["norms"]), torch.tensor(single["norms"]), rtol=1e-5, atol=0)
    for name, value in single["weights"].items():
        torch.testing.assert_close(
            sharded["weights"][name], value, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert single["losses"][0] != single["losses"][1]  # the first update changed the student


def _run_distill_on_rank(config: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms.trainers.distill import run_distill

    run_distill(config)
    return {} if dist.is_initialized() and dist.get_rank() != 0 else {"ok": True}


def test_off_policy_distillation_run_matches_world1_under_fsdp2(
    models: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The whole `mode: off_policy` run: greedy teacher samples (temperature 0) are the same whichever rank
    draws a prompt, so the global batch, the NLL losses and the student's weights match world 1."""
    from safetensors.torch import load_file

    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.loggers import read_metrics
    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.distill import DistillConfig

    root = tmp_path_factory.mktemp("offpolicy")
    assets = tiny_assets(root / "s", seed=21, tokenizer_dir="model", max_operand=6)

    def config(layout: str) -> Any:
        return build_config(DistillConfig, {
            "model": assets["model"], "teacher_model": models["teacher"], "train_file": str(assets["train"]),
            "output_dir": str(root / layout), "layout": layout, "steps": 3, "prompts_per_step": 8,
            "max_new_tokens": 3, "temperature": 0.0, "mode": "off_policy", "progress": False, "eval_every": 0,
            "engine": {"max_tokens_per_microbatch": 40, "optimizer": {"lr": 1e-2}},
        })  # fmt: skip

    _run_distill_on_rank(config("d1"))
    get_rank_pool(2).run(_run_distill_on_rank, config("d2"), timeout_s=300)
    single, sharded = (read_metrics(root / layout / "metrics.jsonl", "train") for layout in ("d1", "d2"))
    for key in ("loss", "grad_norm", "distill/teacher_logprob"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in sharded], dtype=torch.float64),
            torch.tensor([r[key] for r in single], dtype=torch.float64),
            rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}",
        )  # fmt: skip
    assert single[0]["loss"] > single[-1]["loss"]  # the student learned the teacher's tokens
    want, got = (load_file(str(next((root / layout / "hf").glob("*.safetensors")))) for layout in ("d1", "d2"))
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def _train_full(models: dict[str, str], layout: str, loss: str, top_k: int) -> dict[str, Any]:
    """GKD's full-distribution loss: the teacher's [T, V] (or top-k) rows travel with each rank's sequences."""
    import torch.distributed as dist

    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine
    from shardforge.engine.objectives import PPOActorConfig
    from shardforge.engine.objectives.distillation import (
        TEACHER_LOGPROBS,
        TEACHER_TOKEN_IDS,
        DistributionDistillTerm,
        FullDistillActorLossFn,
    )
    from shardforge.engine.objectives.loss_fns import ADVANTAGES

    config = EngineConfig(max_tokens_per_microbatch=24, optimizer=OptimizerConfig(lr=1e-2, eps=1e-6))
    student, teacher = TrainEngine(models["student"], layout, config), TrainEngine(models["teacher"], layout, config)
    mine = _batch().select(list(range(GROUPS))[student.dp_rank :: student.dp_size])
    rows, ids = teacher.forward_distribution(mine, top_k=top_k)
    mine.extras[TEACHER_LOGPROBS] = rows
    if ids is not None:
        mine.extras[TEACHER_TOKEN_IDS] = ids
    mine.extras[ADVANTAGES] = torch.zeros(mine.num_tokens)  # pure distillation: the PPO term is 0
    actor = FullDistillActorLossFn(PPOActorConfig(), DistributionDistillTerm(divergence=loss, beta=0.3))
    history = [student.train_batch(mine, actor, actor.loss_weight) for _ in range(STEPS)]
    full = student.full_state_dict()
    main = not dist.is_initialized() or dist.get_rank() == 0
    result = {"losses": [h["loss"] for h in history], "norms": [h["grad_norm"] for h in history]}
    return result | {"weights": full} if main else {}


@pytest.mark.parametrize(("loss", "top_k"), [("full_reverse_kl", 0), ("jsd", 5)])
def test_full_distribution_distillation_matches_world1_under_fsdp2(
    models: dict[str, str], loss: str, top_k: int
) -> None:
    single = _train_full(models, "d1", loss, top_k)
    sharded = get_rank_pool(2).run(_train_full, models, "d2", loss, top_k, timeout_s=300)[0]
    assert single["losses"][0] > 0.01  # a peaked teacher far from the student (JSD is the smaller: ~0.018)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor(sharded["norms"]), torch.tensor(single["norms"]), rtol=1e-5, atol=0)
    for name, value in single["weights"].items():
        torch.testing.assert_close(
            sharded["weights"][name], value, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert single["losses"][1] < single["losses"][0]  # the update moved the student towards the teacher
