"""Named step phases in RL profiler traces: a traced GRPO / PPO step shows ``shardforge/generate``,
``shardforge/old_logprobs``, ... as ranges in every rank's Chrome trace (trainers/profiling.py)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.config_io import apply_overrides, build_config
from shardforge.algorithms.trainers import TRAINERS
from shardforge.algorithms.trainers.run.profiling import PHASES, phase

REWARD_MODULE = textwrap.dedent(
    """
    def has_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)
    """
)

GRPO_PHASES = {"generate", "old_logprobs", "ref_logprobs", "train", "weight_sync"}
PPO_PHASES = {"generate", "old_logprobs", "values", "ref_logprobs", "train", "weight_sync"}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("phases")
    train = tiny_assets(root, seed=11, max_operand=20, num_eval=16, data_seed=2)["train"]
    (root / "phase_rewards_mod.py").write_text(REWARD_MODULE)
    return {"root": str(root), "model": str(root / "model"), "train": str(train)}


def _traced_run(name: str, model: str, train: str, root: str, out: str, layout: str) -> dict[str, set[str]]:
    """Run 2 traced steps of ``name``; return {trace file name: the shardforge/* range names in it}."""
    if root not in sys.path:  # also in a pool rank's fresh interpreter
        sys.path.insert(0, root)
    engine = {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-3}}
    data: dict[str, Any] = {
        "model": model, "output_dir": out, "layout": layout, "steps": 2, "progress": False,
        "export_hf_at_end": False, "engine": engine, "train_file": train, "prompts_per_step": 2,
        "group_size": 2, "max_new_tokens": 3, "reward_fn": "phase_rewards_mod:has_seven",
        "profile": {"enabled": True, "start_step": 1, "steps": 2},
    }  # fmt: skip
    if name == "grpo":  # the default skips the old-log-prob pass on on-policy batches (no range then)
        data |= {"reuse_training_logprobs": False, "actor": {"kl_coef": 0.05}}  # kl_coef: the reference
    else:  # kl_coef > 0 builds the reference policy
        data |= {"update_epochs": 1, "critic_engine": dict(engine), "kl_coef": 0.05}
    config = build_config(TRAINERS.get(name).config_cls, apply_overrides(data, []))
    TRAINERS.get(name).run(config)
    found: dict[str, set[str]] = {}
    for trace in sorted((Path(out) / "profile").iterdir()):
        events = json.loads(trace.read_text())["traceEvents"]  # Chrome trace JSON (Perfetto opens it)
        names = {str(e.get("name", "")) for e in events}
        found[trace.name] = {n.removeprefix("shardforge/") for n in names if n.startswith("shardforge/")}
    return found


@pytest.mark.parametrize(("name", "expected"), [("grpo", GRPO_PHASES), ("ppo", PPO_PHASES)])
def test_rl_trace_shows_every_phase(name: str, expected: set[str], assets: dict[str, Any], tmp_path: Path) -> None:
    found = _traced_run(name, assets["model"], assets["train"], assets["root"], str(tmp_path), "d1")
    assert list(found) == ["rank0_steps1-2.json"]
    assert found["rank0_steps1-2.json"] >= expected, found
    assert found["rank0_steps1-2.json"] <= set(PHASES)  # only the documented names
    # The same phases' wall times are logged every step: timing_s/<phase> inside timing_s/step.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for row in train:
        timings = {k.removeprefix("timing_s/"): v for k, v in row.items() if k.startswith("timing_s/")}
        step_s = timings.pop("step")
        assert set(timings) >= expected and set(timings) <= set(PHASES), timings
        assert all(v > 0 for v in timings.values()) and step_s > 0, timings
        assert sum(timings.values()) <= step_s * 1.01 + 1e-3, (timings, step_s)  # phases do not overlap here


@pytest.mark.slow  # ~110 s on the shared 2-core machine (pool start-up + 2 ranks), over the ~40 s budget
def test_grpo_writes_a_trace_with_every_phase_per_rank_at_world_2(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.mesh.testing import get_rank_pool

    args = ("grpo", assets["model"], assets["train"], assets["root"], str(tmp_path), "d2")
    found = get_rank_pool(2).run(_traced_run, *args, timeout_s=300)[0]
    assert sorted(found) == ["rank0_steps1-2.json", "rank1_steps1-2.json"]
    for names in found.values():
        assert names >= GRPO_PHASES, found


def test_unknown_phase_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown step phase 'rollout'.*'generate'"):
        phase("rollout")
