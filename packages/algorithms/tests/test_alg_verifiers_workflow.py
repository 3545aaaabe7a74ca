"""``workflow.name: verifiers`` (issue 38): a verifiers 0.4 environment defined here over an in-memory taskset
trains 2 GRPO steps on the tiny chat model; every model call goes through the endpoint, the rubric's rewards are
the batch's rewards, and the trained tokens are the endpoint's recorded ones."""

from __future__ import annotations

import json
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
    from shardforge.algorithms.testing.agent_runs import agent_chat_assets

    return agent_chat_assets(tmp_path_factory.mktemp("verifiers"), "vf_sum_taskset", TASKSET_MODULE)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _run(chat: dict[str, Any], out: Path, **overrides: Any) -> dict[str, Any]:
    from shardforge.algorithms.testing.agent_runs import run_agent_grpo

    return run_agent_grpo(
        chat, out, {"name": "verifiers", "verifiers": {"env": "vf_sum_taskset", "timeout_s": 60}}, **overrides
    )


def _records(out: Path) -> list[dict[str, Any]]:
    from shardforge.algorithms.testing.agent_runs import train_records

    return train_records(out)


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
