"""``workflow.name: verifiers`` (issue 38): a verifiers 0.4 environment defined here over an in-memory taskset
trains 2 GRPO steps on the tiny chat model; every model call goes through the endpoint, the rubric's rewards are
the batch's rewards, and the trained tokens are the endpoint's recorded ones."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1")

# A taskset module (verifiers loads tasksets by module name): prompts "a+a=", a reward that depends on the row
# and the reply, so the logged reward is what this rubric computed.
TASKSET_MODULE = textwrap.dedent(
    """
    import verifiers.v1 as vf

    SCORES = []  # (prompt, reply, reward) as this rubric scored them

    class SumData(vf.TaskData):
        a: int

    class SumTask(vf.Task[SumData]):
        @vf.reward
        async def shaped(self, task, trace) -> float:
            reply = trace.last_reply or ""
            value = task.a / 10 + 0.01 * len(reply)
            SCORES.append((task.prompt, reply, value))
            return value

    class SumTaskset(vf.Taskset[SumTask]):
        def load(self):
            for a in range(8):
                yield SumTask(SumData(prompt=f"{a}+{a}=", a=a))

    __all__ = ["SumTaskset"]
    """
)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import QWEN3_TOOL_TEMPLATE, tiny_chat_assets

    root = tmp_path_factory.mktemp("verifiers")
    (root / "vf_sum_taskset.py").write_text(TASKSET_MODULE)
    sys.path.insert(0, str(root))
    assets = tiny_chat_assets(root, seed=3, chat_template=QWEN3_TOOL_TEMPLATE)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "completion": str(2 * a)}) + "\n" for a in range(8)))
    return assets | {"data": str(data)}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _run(chat: dict[str, Any], out: Path, **overrides: Any) -> dict[str, Any]:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    base = {
        "model": chat["model"], "train_file": chat["data"], "output_dir": str(out), "layout": "d1", "steps": 2,
        "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6, "progress": False, "export_hf_at_end": False,
        "temperature": 1.0, "reward_fn": "exact_match",
        "workflow": {"name": "verifiers", "verifiers": {"env": "vf_sum_taskset", "timeout_s": 60}},
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    return run_grpo(build_config(GRPOConfig, apply_overrides(base, [f"{k}={v}" for k, v in overrides.items()])))


def _records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_grpo_trains_on_a_verifiers_environment_with_its_rubric_rewards(chat: dict[str, Any], tmp_path: Path) -> None:
    import vf_sum_taskset

    vf_sum_taskset.SCORES.clear()
    _run(chat, tmp_path / "a")
    records = _records(tmp_path / "a")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["episodes_failed"] == 0
        assert record["behaviour_kl"] < 1e-4  # the trained tokens are the endpoint's recorded ones, its log-probs
    assert records[-1]["grad_norm"] > 0
    # Every episode was scored by the rubric (2 steps x 2 prompts x 2 samples), and the batch's mean reward is the
    # mean of what the rubric returned (exact_match, the run's reward function, is never called).
    scores = vf_sum_taskset.SCORES
    assert len(scores) == 8
    for step, record in enumerate(records):
        step_scores = [value for _, _, value in scores[4 * step : 4 * step + 4]]
        assert record["reward_mean"] == pytest.approx(sum(step_scores) / 4, abs=1e-5)
    assert all(reply for _, reply, _ in scores)  # the harness saw the endpoint's completions


def test_a_row_that_is_no_task_fails_its_episode_with_the_fix(chat: dict[str, Any], tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "not a task", "completion": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"taskset.s prompts"):
        _run(chat, tmp_path / "o", steps=1, prompts_per_step=1, train_file=str(other))
