"""PPO with image prompts: a value head on the VLM (engine.vision_value) as the critic, world 1 vs FSDP 2."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardforge.algorithms.testing_vlm_ppo import vlm_ppo_steps
from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing_vlm import tiny_vlm_assets

    return tiny_vlm_assets(tmp_path_factory.mktemp("vlm_ppo"), seed=0, num_train=4, num_eval=2)


@pytest.mark.heavy  # ~60-100 s on 2 loaded cores: two engines and a rollout engine per rank, 2 PPO iterations
def test_vlm_ppo_world1_matches_fsdp2(vlm: dict[str, Any]) -> None:
    single = vlm_ppo_steps(vlm["model"], str(vlm["train"]), "d1")
    mask = single["loss_mask"] != 0
    blind = (single["values"] - single["blind_values"])[mask].abs().max()
    assert blind > 1e-3, f"zeroed pixels change the critic's values by only {blind}: it does not see the images"
    ranks = get_rank_pool(2).run(vlm_ppo_steps, vlm["model"], str(vlm["train"]), "d2", timeout_s=600)
    # Every rank samples world 1's responses (step 2: from the weights published after step 1) ...
    assert all(r["rewards"] == single["rewards"] for r in ranks), [r["rewards"] for r in ranks]
    # ... and the critic gives each rank's tokens world 1's old values (fp32: rounding only).
    for step in range(len(single["old_values"])):
        by_rank = {}
        for r in ranks:
            for seq, values in zip(r["mine"], _per_sequence(r, step)):
                by_rank[seq] = values
        for seq, values in enumerate(_per_sequence(single, step)):
            torch.testing.assert_close(by_rank[seq], values, rtol=1e-5, atol=1e-5, msg=f"step {step} sequence {seq}")
    sharded = ranks[0]
    for key in ("losses", "critic_losses"):
        torch.testing.assert_close(torch.tensor(sharded[key]), torch.tensor(single[key]), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(sharded["values"], single["values"], rtol=1e-5, atol=1e-5)
    for side in ("actor_weights", "critic_weights"):
        for key, value in sharded[side].items():
            torch.testing.assert_close(value, single[side][key], rtol=0, atol=2e-5, msg=f"{side} {key}")
    initial = single["critic_weights"]
    assert initial["lm_head.weight"].shape[0] == 1, "the critic's head is a [hidden] -> 1 value head"
    assert single["values"][mask].std() > 1e-4, "the critic's values vary over tokens"


def _per_sequence(result: dict[str, Any], step: int) -> list[torch.Tensor]:
    """One step's old values of a rank, split into its trajectories."""
    bounds = result["cu_seqlens"][step].tolist()
    return [result["old_values"][step][a:b] for a, b in itertools.pairwise(bounds)]
