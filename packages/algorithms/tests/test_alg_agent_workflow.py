"""``workflow.name: agent`` (issue 38): GRPO trains an agent written against the real ``openai`` client only;
its requests go through the endpoint into the trainer's request queue; the trajectories are the engine's
own tokens; an agent that raises or times out fails its episode only."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai")

AGENT_MODULE = textwrap.dedent(
    """
    import asyncio

    import openai  # no shardforge import: any OpenAI-client agent

    async def run(client: openai.AsyncOpenAI, row: dict) -> float:
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
        )
        text = reply.choices[0].message.content or ""
        return float(any(c.isdigit() for c in text)) + 0.1 * len(text)

    async def scored_by_the_run(client, row):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        return None

    async def crashes_on_odd_rows(client, row):
        if row["index"] % 2:
            raise RuntimeError("the agent fell over")
        return await run(client, row)

    async def too_slow(client, row):
        await asyncio.sleep(30)
        return 0.0
    """
)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing.agent_runs import agent_chat_assets

    return agent_chat_assets(tmp_path_factory.mktemp("agent"), "openai_agent_mod", AGENT_MODULE)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _run(chat: dict[str, Any], out: Path, **overrides: Any) -> dict[str, Any]:
    from shardforge.algorithms.testing.agent_runs import run_agent_grpo

    return run_agent_grpo(
        chat, out, {"name": "agent", "agent": {"run": "openai_agent_mod:run", "timeout_s": 60}}, **overrides
    )


def _records(out: Path) -> list[dict[str, Any]]:
    from shardforge.algorithms.testing.agent_runs import train_records

    return train_records(out)


def test_grpo_trains_an_openai_client_agent(chat: dict[str, Any], tmp_path: Path) -> None:
    _run(chat, tmp_path / "a")
    records = _records(tmp_path / "a")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["episodes_failed"] == 0
        assert record["behaviour_kl"] < 1e-4  # the trained tokens are the engine's, with its log-probs
    assert records[-1]["grad_norm"] > 0
    # The agent's own rewards (0.1 per character, +1 with a digit) reached the batch; the run's reward function
    # (exact_match against "2a") would score these untrained completions 0.
    assert max(r["reward_mean"] for r in records) > 0.05


def test_an_agent_trains_under_async_partial_rollouts(chat: dict[str, Any], tmp_path: Path) -> None:
    """The agent's requests go through the same request queue as every workflow's, so asynchronous rollouts with
    partial rollouts on (new weights checked every 2 tokens) and the decoupled loss run it unchanged: 3 steps, every
    episode trained, steps 2-3 trained on episodes sampled one version back (recorded per token). Whether a
    generation is actually interrupted here depends on timing (6-token answers), so that is not asserted; the
    partial-rollout tests prove the interruption itself."""
    overrides = {
        "steps": 3, "async_rollouts": True, "max_staleness": 1, "rollout.partial_rollouts": True,
        "rollout.interrupt_chunk_tokens": 2,
    }  # fmt: skip
    _run(chat, tmp_path / "p", **overrides)
    records = _records(tmp_path / "p")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["episodes_failed"] == 0
    assert records[0]["behaviour_kl"] < 1e-4  # step 1: sampled under the weights it trains
    assert [r["partial/token_staleness_max"] for r in records[1:]] == [1.0, 1.0]  # one version back, never more
    assert 0 < records[-1]["behaviour_kl"] < 0.2  # stale tokens: the decoupled loss's proximal term is in use
    assert records[-1]["grad_norm"] > 0


def test_an_agent_returning_none_is_scored_by_the_runs_reward_function(chat: dict[str, Any], tmp_path: Path) -> None:
    _run(chat, tmp_path / "n", steps=1, **{"workflow.agent.run": "openai_agent_mod:scored_by_the_run"})
    assert _records(tmp_path / "n")[0]["reward/calls"] == 4.0  # exact_match over the 4 episodes


def test_a_crashing_or_slow_agent_fails_only_its_episode(chat: dict[str, Any], tmp_path: Path) -> None:
    overrides = {
        "steps": 1,
        "workflow.max_failed_fraction": 0.5,
        "workflow.agent.run": "openai_agent_mod:crashes_on_odd_rows",
    }
    _run(chat, tmp_path / "c", **overrides)
    assert _records(tmp_path / "c")[0]["episodes_failed"] == 2  # the odd row's group of 2
    slow = {"steps": 1, "workflow.agent.run": "openai_agent_mod:too_slow", "workflow.agent.timeout_s": 0.5}
    with pytest.raises(RuntimeError, match=r"timeout_s=0.5"):
        _run(chat, tmp_path / "s", **slow)


COMMAND_AGENT = textwrap.dedent(
    """
    # An agent as a separate program (no shardforge import): the episode's endpoint and key come from the
    # environment, the row from stdin; the last line printed is the reward.
    import json
    import os
    import sys

    import openai

    row = json.loads(sys.stdin.read())
    assert json.loads(os.environ["SHARDFORGE_ROW"]) == row
    if row["index"] % 2 and "--crash-odd" in sys.argv:
        sys.exit("the agent fell over")
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    print("a log line the trainer ignores")
    print(5.0 + 0.1 * len(reply.choices[0].message.content or ""))
    """
)


def test_an_external_command_agent_trains_and_a_failing_one_fails_only_its_episode(
    chat: dict[str, Any], tmp_path: Path
) -> None:
    script = Path(chat["data"]).parent / "command_agent.py"
    script.write_text(COMMAND_AGENT)
    command = f"[{sys.executable}, {script}]"
    _run(chat, tmp_path / "x", steps=1, **{"workflow.agent.run": "", "workflow.agent.command": command})
    [record] = _records(tmp_path / "x")
    assert record["episodes_failed"] == 0 and record["behaviour_kl"] < 1e-4
    assert 5.0 <= record["reward_mean"] <= 7.0  # the program's rewards (5 + 0.1 per character), not exact_match's 0
    crashing = f"[{sys.executable}, {script}, --crash-odd]"
    overrides = {"workflow.agent.run": "", "workflow.agent.command": crashing, "workflow.max_failed_fraction": 0.5}
    _run(chat, tmp_path / "y", steps=1, **overrides)
    assert _records(tmp_path / "y")[0]["episodes_failed"] == 2  # the odd row's group of 2


def test_agent_config_takes_a_function_or_a_command_not_both() -> None:
    from shardforge.rollout.workflows.base import AgentConfig

    with pytest.raises(ValueError, match="not both"):
        AgentConfig(run="m:f", command=("python", "a.py"))
    with pytest.raises(ValueError, match="list of words"):
        AgentConfig(command="python a.py")  # type: ignore[arg-type]


def test_an_external_agent_past_its_timeout_is_killed(chat: dict[str, Any], tmp_path: Path) -> None:
    import time

    marker = f"slow-agent-{tmp_path.name}"
    command = f"[{sys.executable}, -c, 'import time; time.sleep(60)', {marker}]"
    slow = {"workflow.agent.run": "", "workflow.agent.command": command, "workflow.agent.timeout_s": 0.5}
    with pytest.raises(RuntimeError, match=r"timeout_s=0.5"):
        _run(chat, tmp_path / "t", steps=1, **slow)
    time.sleep(0.5)
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                left.append(cmdline.parent.name)
        except OSError:  # the process ended meanwhile
            pass
    assert not left, f"agent programs {left} outlived their episodes"
