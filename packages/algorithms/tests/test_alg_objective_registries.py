"""Objective registries: names pick losses/estimators/KL/aggregations/rewards/rollout engines,
unknown names list the registered ones, users extend by decorator or import path, and importing
the SFT trainer imports no vLLM (nor rollout) code."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shardforge.engine.objectives import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PPOActorConfig,
    broadcast_to_tokens,
    kl_estimate,
    ppo_actor_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from shardforge.engine.objectives.advantages import group_advantages
from shardforge.rewards import REWARD_FUNCTIONS, exact_match_reward, load_reward_fn
from shardforge.rollout import ROLLOUT_ENGINES


def test_verl_names_are_registered() -> None:
    assert {"vanilla", "gspo"} <= set(POLICY_LOSSES.names())
    assert {"gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(
        ADVANTAGE_ESTIMATORS.names()
    )
    assert {"k1", "k2", "k3", "abs", "kl", "mse"} <= set(KL_ESTIMATORS.names())
    assert {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "token-sum",
    } <= set(AGGREGATIONS.names())
    assert REWARD_FUNCTIONS.get("exact_match") is exact_match_reward
    assert ROLLOUT_ENGINES.names() == ["hf", "vllm"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy_loss": "ppo2"}, r"unknown policy_loss 'ppo2'; registered: \['cispo', 'clip_cov'"),
        ({"kl_estimator": "k9"}, r"unknown kl_estimator 'k9'; registered: \['abs', 'k1'"),
        ({"aggregation": "mean"}, r"unknown loss aggregation 'mean'; registered: \['seq-mean-token-mean'"),
    ],
)
def test_unknown_names_list_the_registered_ones(kwargs: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PPOActorConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_reward_function_lists_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown reward function 'exactly'; registered: \[") as err:
        load_reward_fn("exactly")
    assert "'exact-match'" in str(err.value).split("registered: ", 1)[1]


def test_kl_aliases_and_abs() -> None:
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.equal(kl_estimate(lp, ref, "kl"), kl_estimate(lp, ref, "k1"))
    assert torch.equal(kl_estimate(lp, ref, "mse"), kl_estimate(lp, ref, "k2"))
    assert torch.allclose(kl_estimate(lp, ref, "abs"), (ref - lp).abs())


def test_gspo_equals_vanilla_with_sequence_ratios() -> None:
    torch.manual_seed(0)
    cu = torch.tensor([0, 4, 9])
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.float32)
    lp = (torch.randn(9) * 0.1 - 1).requires_grad_()
    common = {"old_logprobs": lp.detach() + 0.05 * torch.randn(9), "advantages": torch.randn(9)}
    gspo = ppo_actor_loss(lp, loss_mask=mask, cu_seqlens=cu, config=PPOActorConfig(policy_loss="gspo"), **common)
    seq = ppo_actor_loss(lp, loss_mask=mask, cu_seqlens=cu, config=PPOActorConfig(ratio_level="sequence"), **common)
    tok = ppo_actor_loss(lp, loss_mask=mask, cu_seqlens=cu, config=PPOActorConfig(), **common)
    assert torch.equal(gspo.loss_sum, seq.loss_sum) and not torch.equal(gspo.loss_sum, tok.loss_sum)


def test_user_registered_and_import_path_estimators() -> None:
    @ADVANTAGE_ESTIMATORS.register("test_sign")
    def sign(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """sign of the reward"""
        return torch.sign(rewards)

    rewards = torch.tensor([1.0, -2.0, 0.0, 3.0])
    assert torch.equal(group_advantages(rewards, 2, "test_sign"), torch.sign(rewards))
    by_path = group_advantages(rewards, 2, "shardforge.engine.objectives.advantages:rloo_advantages")
    assert torch.equal(by_path, group_advantages(rewards, 2, "rloo"))
    with pytest.raises(ValueError, match="'gae' needs a critic"):
        group_advantages(rewards, 2, "gae")


def test_reinforce_pp_reachable_from_group_advantages_and_equal_to_token_form() -> None:
    # equal response lengths: the sequence-weighted outcome form equals the token-level one
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    lengths, prompt = 3, 2
    cu = torch.arange(0, 6 * (prompt + lengths) + 1, prompt + lengths)
    mask = torch.tensor(([0.0] * prompt + [1.0] * lengths) * 6)
    for name, token_level in (
        ("reinforce_plus_plus", reinforce_pp_advantages(rewards, mask, cu)),
        ("reinforce_plus_plus_baseline", reinforce_pp_baseline_advantages(rewards, mask, cu, 3)),
    ):
        per_seq = group_advantages(rewards, 3, name)
        assert torch.allclose(broadcast_to_tokens(per_seq, mask, cu), token_level, atol=1e-6), name
    assert torch.equal(group_advantages(torch.ones(4), 2, "reinforce_plus_plus"), torch.zeros(4))


def test_importing_sft_or_the_package_imports_no_vllm_or_rollout_code() -> None:
    code = (
        "import shardforge.algorithms, shardforge.algorithms.trainers.sft, sys; "
        "print([m for m in sys.modules if 'vllm' in m]); "
        "print([m for m in sys.modules if m.startswith('shardforge.rollout')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines() == ["[]", "[]"]


def test_rollout_package_does_not_import_vllm_modules() -> None:
    code = "import shardforge.rollout as r, sys; r.build_rollout_engine; print([m for m in sys.modules if 'vllm' in m])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
