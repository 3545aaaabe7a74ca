"""PPO with image prompts: a value head on the VLM (engine.vision_value) as the critic, world 1 vs FSDP 2."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardforge.algorithms.testing.vlm_ppo import vlm_ppo_steps
from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

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


def test_ppo_trainer_runs_on_image_rows(vlm: dict[str, Any], tmp_path: Any) -> None:
    """`shardforge train ppo`'s config on a VLM (one step, one process): image prompts, the VLM critic with a
    frozen vision tower, held-out evals; the actor's export holds the image processor, no critic export."""
    import json

    from transformers import AutoImageProcessor

    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.ppo import PPOConfig, run_ppo

    data = {
        "model": vlm["model"], "train_file": str(vlm["train"]), "eval_file": str(vlm["eval"]),
        "output_dir": str(tmp_path), "layout": "d1", "steps": 1, "prompts_per_step": 2, "group_size": 2,
        "max_new_tokens": 4, "progress": False, "save_every": 0, "resume": "never", "kl_coef": 0.0,
        "reward_fn": "shardforge.algorithms.testing.vlm:colour_overlap_reward",
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 3e-3}},
        "critic_engine": {"max_tokens_per_microbatch": 256, "freeze_module_prefix": ["model.visual"]},
    }  # fmt: skip
    summary = run_ppo(build_config(PPOConfig, apply_overrides(data, [])))
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in train if r["split"] == "train")
    assert step["reward_std"] > 0 and step["critic/loss"] > 0, step
    assert "accuracy_start" in summary and "accuracy_end" in summary and "critic_hf_dir" not in summary
    processor = AutoImageProcessor.from_pretrained(summary["hf_dir"])
    assert processor.to_dict() == AutoImageProcessor.from_pretrained(vlm["model"]).to_dict()
