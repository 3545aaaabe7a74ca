"""``workflow.name: openenv`` (issue 38) against the real ``openenv-core`` 0.3.0: an OpenEnv environment defined here
(its ``create_app``) is served by uvicorn in local subprocesses; episodes run over openenv's own client, the model's
replies are the actions, the environment's step rewards the rewards."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core")

from shardforge.rollout import Rollout, SamplingParams
from shardforge.rollout.workflows import PromptRow, WorkflowConfig, build_workflow, run_episodes
from shardforge.rollout.workflows.base import OpenEnvConfig

# Two steps per episode: "Double it: <prompt>", then "Try again."; each step's reward depends on the row and the
# reply, and the environment logs what it got and gave (OPENENV_TEST_LOG), so the test knows the true rewards.
# OPENENV_TEST_DIE: a marker file; the first reset that removes it kills its server (a crash).
ENV_MODULE = textwrap.dedent(
    """
    import json, os, uuid

    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action, Observation, State

    class ReplyAction(Action):
        message: str

    class TextObservation(Observation):
        prompt: str = ""

    class DoublingEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, prompt="", reference="", **kwargs):
            marker = os.environ.get("OPENENV_TEST_DIE")
            if marker:
                try:
                    os.unlink(marker)
                    os._exit(3)
                except FileNotFoundError:
                    pass
            self.id, self.prompt, self.reference, self.seed = uuid.uuid4().hex, prompt, reference, seed
            self._state = State(episode_id=self.id, step_count=0)
            return TextObservation(prompt=f"Double it: {prompt}")

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            reply = action.message
            reward = float(reply.strip() == self.reference) + 0.01 * len(reply) + 0.1 * int(self.reference)
            with open(os.environ["OPENENV_TEST_LOG"], "a") as log:
                log.write(json.dumps({"episode": self.id, "prompt": self.prompt, "seed": self.seed,
                                      "step": self._state.step_count, "reply": reply, "reward": reward}) + "\\n")
            done = self._state.step_count >= 2
            return TextObservation(prompt="Try again.", done=done, reward=reward)

        @property
        def state(self):
            return self._state

    app = create_app(DoublingEnv, ReplyAction, TextObservation, env_name="doubling", max_concurrent_envs=64)
    """
)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing.agent_runs import agent_chat_assets

    return agent_chat_assets(tmp_path_factory.mktemp("openenv"), "openenv_doubling_env", ENV_MODULE)


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    log = tmp_path / "env_log.jsonl"
    monkeypatch.setenv("OPENENV_TEST_LOG", str(log))
    return log


def _episodes(log: Path) -> dict[str, list[dict[str, Any]]]:
    """The environment's log per episode, episodes in the order they first stepped."""
    episodes: dict[str, list[dict[str, Any]]] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        episodes.setdefault(entry["episode"], []).append(entry)
    return episodes


class ScriptedEngine:
    """Answers every prompt of call ``k`` with ``script[k]`` (+ EOS)."""

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        self.tokenizer, self.script, self.calls = tokenizer, script, 0

    def generate(self, prompts: Any, params: SamplingParams) -> list[Rollout]:
        text = self.script[self.calls]
        self.calls += 1
        ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
        return [Rollout(prompt_index=i, prompt_ids=list(p), response_ids=ids, logprobs=[-0.5] * len(ids),
                        finished=True, version=3, text=text) for i, p in enumerate(prompts)]  # fmt: skip

    def update_weights(self, version: int | None = None) -> int:
        return 3


def test_openenv_episodes_are_token_exact_and_scored_by_the_environment(chat: dict[str, Any], _env: Path) -> None:
    tokenizer = chat["tokenizer"]
    config = WorkflowConfig(name="openenv", max_turns=4, chat_template=True,
                            openenv=OpenEnvConfig(app="openenv_doubling_env:app"))  # fmt: skip
    workflow = build_workflow(config, tokenizer, lambda *a: pytest.fail("reward_fn must not be called"))
    try:
        row = PromptRow(index=0, prompt="4+4=", reference="8", prompt_ids=[1, 2], seed=11)
        trajectories = run_episodes(workflow, ScriptedEngine(tokenizer, ["41", "8"]), [row], 2, SamplingParams())
    finally:
        workflow.close()  # type: ignore[attr-defined]
    assert len(trajectories) == 2
    episodes = list(_episodes(_env).values())
    assert len(episodes) == 2
    for trajectory, steps in zip(trajectories, episodes, strict=True):
        assert [s["reply"] for s in steps] == ["41", "8"], "the model's replies are the actions"
        assert {s["seed"] for s in steps} == {11} and {s["prompt"] for s in steps} == {"4+4="}
        assert trajectory.reward == pytest.approx(sum(s["reward"] for s in steps), abs=1e-9)
        assert trajectory.stop_reason == "done" and [t.reward for t in trajectory.turns] == [s["reward"] for s in steps]
        text = tokenizer.decode(trajectory.token_ids)
        assert text == ("<|im_start|>user\nDouble it: 4+4=<|im_end|>\n<|im_start|>assistant\n41<|im_end|>\n"
                        "<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n8<|im_end|>")  # fmt: skip
        generated = tokenizer.decode([i for i, m in zip(trajectory.token_ids, trajectory.loss_mask) if m])
        assert generated == "41<|im_end|>8<|im_end|>", "only the model's tokens carry loss"
        assert trajectory.logprobs.count(-0.5) == sum(trajectory.loss_mask)


def _run(chat: dict[str, Any], out: Path, **openenv: Any) -> list[dict[str, Any]]:
    from shardforge.algorithms.testing.agent_runs import run_agent_grpo, train_records

    options = {"app": "openenv_doubling_env:app", "timeout_s": 120, **openenv}
    workflow = {"name": "openenv", "chat_template": True, "max_turns": 3, "openenv": options,
                "max_failed_fraction": 0.5}  # fmt: skip
    run_agent_grpo(chat, out, workflow)
    return train_records(out)


def test_grpo_trains_on_an_openenv_server_with_its_step_rewards(
    chat: dict[str, Any], tmp_path: Path, _env: Path
) -> None:
    records = _run(chat, tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    episodes = list(_episodes(_env).values())
    assert len(episodes) == 8 and all(len(steps) == 2 for steps in episodes)
    for step, record in enumerate(records):
        assert record["episodes_failed"] == 0
        assert record["episode/stop/done"] == 1.0 and record["episode/turns"] == 2.0
        assert record["behaviour_kl"] < 1e-4  # the trained tokens are the ones the engine sampled, with their log-probs
        returns = [sum(s["reward"] for s in steps) for steps in episodes[4 * step : 4 * step + 4]]
        assert record["reward_mean"] == pytest.approx(sum(returns) / 4, abs=1e-5)
    assert records[-1]["grad_norm"] > 0


def test_a_server_that_dies_fails_only_its_episodes(chat: dict[str, Any], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    marker = tmp_path / "die"
    marker.write_text("")
    monkeypatch.setenv("OPENENV_TEST_DIE", str(marker))
    records = _run(chat, tmp_path / "run", num_servers=2)
    assert not marker.exists()
    # Step 1: one server died at its first reset: its group's episodes failed (both, or one when the other asked for
    # the server after it died and got it restarted), the other server's group trained. Step 2: the dead server was
    # started again and nothing failed.
    assert 1 <= records[0]["episodes_failed"] <= 2 and records[1]["episodes_failed"] == 0
    assert all(r["episode/stop/done"] == 1.0 for r in records), "the kept episodes ran to the environment's end"
