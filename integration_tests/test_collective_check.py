"""Every trainer at world 2 (FSDP 2, gloo) under `CollectiveRecorder`: algorithms code issues no raw
tensor collective outside ``batching/collectives.py`` and the engine, every collective tensor is on
the device its backend needs, and every helper call gets the engine's device.

The same run on CUDA (NCCL) would flag a CPU tensor handed to a collective by rule 2 (see
`shardforge.algorithms.testing.collective_check`); the last test shows that rule and rule 3 firing.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from shardforge.mesh.testing import get_rank_pool

REWARD_MODULE = textwrap.dedent(
    """
    def has_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)
    """
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("collective_check")
    _tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=8, data_seed=2)
    train, evaluation = _tiny["train"], _tiny["eval"]
    pairs = root / "pairs.jsonl"
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "x"} for i in range(8)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "cc_rewards_mod.py").write_text(REWARD_MODULE)
    return {"root": str(root), "model": str(root / "model"), "train": str(train), "eval": str(evaluation),
            "pairs": str(pairs)}  # fmt: skip


def _run_recorded(name: str, assets: dict[str, str], out: str, async_rollouts: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.testing.collective_check import CollectiveRecorder
    from shardforge.algorithms.trainers import TRAINERS

    sys.path.insert(0, assets["root"])
    engine = {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-3}}
    data: dict[str, Any] = {
        "model": assets["model"], "output_dir": out, "layout": "d2", "steps": 2, "save_every": 1,
        "progress": False, "export_hf_at_end": False, "engine": engine,
    }  # fmt: skip
    if name == "sft":
        data |= {"train_file": assets["train"], "eval_file": assets["eval"], "global_batch_size": 4}
    elif name == "rm":
        data |= {"train_file": assets["pairs"], "eval_file": assets["pairs"], "global_batch_size": 2}
    else:
        data |= {"train_file": assets["train"], "eval_file": assets["eval"], "prompts_per_step": 2, "group_size": 2,
                 "max_new_tokens": 3, "reward_fn": "cc_rewards_mod:has_seven", "eval_size": 4}  # fmt: skip
    if name == "grpo" and async_rollouts:
        data |= {"async_rollouts": True, "max_staleness": 1}
    if name == "ppo":
        data |= {"update_epochs": 1, "kl_coef": 0.05, "critic_engine": dict(engine)}
    spec = TRAINERS.get(name)
    with CollectiveRecorder() as recorder:
        spec.run(build_config(spec.config_cls, data))
    origins: dict[str, int] = {}
    for call in recorder.calls:
        origins[call.origin] = origins.get(call.origin, 0) + 1
    return {
        "rank": dist.get_rank(),
        "problems": recorder.problems(expected_device="cpu"),
        "origins": origins,
        "backends": sorted({c.backend for c in recorder.calls}),
        "helper_callers": sorted(
            {"/".join(c.caller.split(":")[0].split("/")[-2:]) for c in recorder.calls if c.caller}
        ),
    }


@pytest.mark.parametrize(("name", "async_rollouts"), [("sft", False), ("rm", False), ("grpo", False),
                                                      ("grpo", True), ("ppo", False)])  # fmt: skip
def test_trainer_collectives_go_through_the_helper_on_the_engine_device(
    name: str, async_rollouts: bool, assets: dict[str, str], tmp_path: Path
) -> None:
    results = get_rank_pool(2).run(_run_recorded, name, assets, str(tmp_path / "run"), async_rollouts, timeout_s=600)
    for result in results:
        assert result["problems"] == [], result["problems"]
        assert result["backends"] == ["gloo"]
        assert result["origins"].get("helper", 0) > 0, result  # the trainers' scalars went through the helper
        assert result["origins"].get("algorithms", 0) == 0 or name == "grpo", result  # only object collectives
    expected = {"sft": set(), "rm": {"rl/ppo_update.py"}, "ppo": {"rl/metrics.py", "rl/ppo_update.py"}}
    callers = set(results[0]["helper_callers"])
    if name in expected:
        assert expected[name] <= callers, callers
    else:
        assert {"rl/metrics.py", "rl/workflow_stats.py"} <= callers, callers


def _grpo_step_stat_collectives(assets: dict[str, str], out: str) -> list[str]:
    """The scalar/stat collectives (helper calls from code above the engine) of GRPO's second step, outside
    ``train_batch`` (whose statistics the engine reduces itself), as ``op caller`` lines."""
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.testing.collective_check import CollectiveRecorder
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo
    from shardforge.core import hooks

    sys.path.insert(0, assets["root"])
    data = {
        "model": assets["model"], "output_dir": out, "layout": "d2", "steps": 2, "progress": False,
        "export_hf_at_end": False, "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-3}},
        "train_file": assets["train"], "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3,
        "reward_fn": "cc_rewards_mod:has_seven",
    }  # fmt: skip
    recorder, marks = CollectiveRecorder(), {}
    hooks.register("step_start", lambda step: marks.__setitem__(("start", step), len(recorder.calls)))
    hooks.register("step_end", lambda step: marks.__setitem__(("end", step), len(recorder.calls)))
    try:
        with recorder:
            run_grpo(build_config(GRPOConfig, data))
    finally:
        hooks.clear()
    step = recorder.calls[marks[("start", 2)] : marks[("end", 2)]]
    # The run loop's stop-signal agreement (trainers/run/stop.py: SIGTERM on one rank stops all) is every
    # trainer's, once per step, and carries no statistic: not the RL step's.
    stats = [c for c in step if c.origin == "helper" and c.caller_origin == "algorithms" and "/run/" not in c.caller]
    return [f"{c.op} {c.caller}" for c in stats]


def test_a_grpo_step_reduces_its_statistics_in_at_most_two_collectives(assets: dict[str, str], tmp_path: Path) -> None:
    """Issue 37: a GRPO step at world 2 makes at most 2 scalar/stat collectives outside ``train_batch`` (there were
    about 12, one per stats helper): the failed-episodes agreement before the update and the step's `StepMetrics`
    reduction at its end."""
    results = get_rank_pool(2).run(_grpo_step_stat_collectives, assets, str(tmp_path / "grpo"), timeout_s=600)
    for calls in results:
        assert 1 <= len(calls) <= 2, calls
        assert any("rl/metrics.py" in c for c in calls), calls


def test_the_recorder_flags_a_cpu_tensor_for_an_accelerator_backend_and_a_missing_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """World 1, gloo: pretend gloo needed CUDA tensors (as NCCL does): a CPU tensor is flagged at
    its call site; a helper call without ``device=`` is flagged on CPU too."""
    import torch
    import torch.distributed as dist

    from shardforge.algorithms.testing import collective_check
    from shardforge.mesh.collectives import all_reduce_sum

    original = dist.all_reduce
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with collective_check.CollectiveRecorder() as recorder:
            dist.all_reduce(torch.ones(2))
            all_reduce_sum(1.0, group=dist.group.WORLD, device=torch.device("cpu"))
            all_reduce_sum(2.0, group=dist.group.WORLD)
        assert [c.op for c in recorder.calls] == ["all_reduce"] * 3
        assert [c.origin for c in recorder.calls] == ["other", "helper", "helper"]
        assert recorder.calls[1].caller.startswith(__file__) and recorder.calls[1].helper_device == "cpu"
        problems = recorder.problems(expected_device="cpu")
        assert len(problems) == 1 and "without device=" in problems[0] and __file__ in problems[0]
        monkeypatch.setitem(collective_check.BACKEND_DEVICE, "gloo", "cuda")  # as for NCCL
        problems = recorder.problems()
        assert sum("['cpu'] on gloo" in p for p in problems) == 3, problems
        assert f"{__file__}:" in problems[0]
        assert dist.all_reduce is original  # restored on exit
    finally:
        dist.destroy_process_group()
