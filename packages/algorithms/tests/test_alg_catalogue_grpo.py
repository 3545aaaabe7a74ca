"""The catalogue's losses and estimators are one config line away: a GRPO run picks them by name
from YAML-style overrides (actor.policy_loss=..., advantage=...)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.config_io import apply_overrides, build_config


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("catalogue")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=8, data_seed=2)
    return {"model": str(root / "model"), "train": tiny["train"], "eval": tiny["eval"]}


def _config(assets: dict[str, Any], out: Path, overrides: list[str]) -> Any:
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(out), "layout": "d1",
        "steps": 1, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4, "progress": False,
        "save_every": 0, "export_hf_at_end": False, "resume": "never",
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-3}},
    }  # fmt: skip
    return build_config(GRPOConfig, apply_overrides(data, overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.policy_loss=geo_mean", "actor.aggregation=seq-mean-token-mean", "advantage=opo"],
        ["actor.policy_loss=cispo", "actor.clip_eps_high=0.28", "advantage=reinforce_plus_plus_baseline"],
        ["actor.policy_loss=sapo", "actor.aggregation=token-sum", "advantage=remax"],
        [
            "actor.policy_loss=dppo_tv",
            "actor.clip_eps_low=0.15",
            "actor.clip_eps_high=0.15",
            "rollout_correction.mode=bypass",
        ],
    ],
    ids=["gmpo-opo", "cispo-rpp", "sapo-tokensum-remax", "dppo-tv-bypass"],
)
def test_grpo_runs_catalogue_entries_by_name(assets: dict[str, Any], tmp_path: Path, overrides: list[str]) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    run_grpo(_config(assets, tmp_path, overrides))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    [train] = [r for r in rows if r["split"] == "train"]
    assert math.isfinite(train["loss"]) and math.isfinite(train["actor/pg_loss"])
