"""Workflows: token-in/token-out multi-turn trajectories on the embedded HF engine (a chat template
that is not prefix-stable), behaviour vs recomputed log-probs, round batching, tool calls and every
bad-call kind, the python tool's limits, trajectories -> packed batch, and GRPO with workflow.name."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS
from shardforge.rollout import Rollout, SamplingParams
from shardforge.rollout.workflows import (
    WORKFLOWS,
    MultiTurnConfig,
    PromptRow,
    ToolUseConfig,
    Trajectory,
    WorkflowConfig,
    build_workflow,
    run_episodes,
)
from shardforge.rollout.workflows.tools import calculator, load_tools, python, run_tool_call, tool_schema

USER_MODULE = textwrap.dedent(
    """
    def add(a: int, b: int) -> int:
        '''Add two integers.'''
        return a + b

    def broken(x: str) -> str:
        raise KeyError("tool bug")

    def has_digit(prompt, response, reference):
        return float(any(c.isdigit() for c in response))
    """
)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_chat_assets

    root = tmp_path_factory.mktemp("chat")
    (root / "wf_user_mod.py").write_text(USER_MODULE)
    sys.path.insert(0, str(root))
    return tiny_chat_assets(root, seed=3)


def _rows(tokenizer: Any, prompts: list[str]) -> list[PromptRow]:
    return [
        PromptRow(index=i, prompt=p, reference="42", prompt_ids=tokenizer(p, add_special_tokens=False)["input_ids"])
        for i, p in enumerate(prompts)
    ]


class ScriptedEngine:
    """A rollout engine that answers with scripted texts (turn by turn) and records every call."""

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        self.tokenizer, self.script, self.calls, self.version = tokenizer, script, [], 7

    def generate(self, prompts: Any, params: SamplingParams) -> list[Rollout]:
        self.calls.append([list(p) for p in prompts])
        turn = len(self.calls) - 1
        outs = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer(self.script[turn], add_special_tokens=False)["input_ids"] + [
                self.tokenizer.eos_token_id
            ]
            outs.append(
                Rollout(
                    prompt_index=i,
                    prompt_ids=list(prompt),
                    response_ids=ids,
                    logprobs=[-0.5] * len(ids),
                    finished=True,
                    version=self.version,
                    text=self.script[turn],
                )
            )
        return outs

    def update_weights(self, version: int | None = None) -> int:
        return self.version


def test_multi_turn_is_token_in_token_out_and_logprobs_match_the_trainer(chat: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    from shardforge.rollout import HFRolloutEngine

    tokenizer = chat["tokenizer"]
    config = WorkflowConfig(
        name="multi_turn", max_turns=3, chat_template=True, multi_turn=MultiTurnConfig(turn_discount=0.5)
    )
    workflow = build_workflow(config, tokenizer, lambda p, r, ref: 0.0)
    engine = HFRolloutEngine(chat["model"], tokenizer)
    calls: list[list[list[int]]] = []
    generate = engine.generate

    def recording_generate(prompts: Any, params: SamplingParams, **sessions: Any) -> list[Rollout]:
        calls.append([list(p) for p in prompts])
        return generate(prompts, params, **sessions)

    engine.generate = recording_generate  # type: ignore[method-assign]
    rows = _rows(tokenizer, ["what is 6*7?", "and 40+2?"])
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=4)
    trajectories = run_episodes(workflow, engine, rows, 2, params)
    assert len(trajectories) == 4 and all(len(t.turns) == 3 and t.stop_reason == "max_turns" for t in trajectories)
    assert len(calls) == 3 and [len(c) for c in calls] == [4, 4, 4], (
        "one batched engine call per round, not per episode"
    )
    for k, t in enumerate(trajectories):
        # The ids the engine was fed at turn r are exactly a prefix of the trajectory (never re-tokenised).
        for r in range(3):
            fed = calls[r][k]
            assert t.token_ids[: len(fed)] == fed
        # The template is not prefix-stable: re-rendering the conversation gives other ids.
        messages = [{"role": "user", "content": rows[t.group].prompt}]
        rendered = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": "x"}], tokenize=False)
        assert "<think></think>" in rendered
        assert sum(t.loss_mask) == sum(turn.generated for turn in t.turns)
        assert {v for v, m in zip(t.versions, t.loss_mask) if m} == {0}
    # The trainer's recomputation of the generated tokens' log-probs equals the behaviour log-probs.
    model = AutoModelForCausalLM.from_pretrained(chat["model"])
    worst = 0.0
    for t in trajectories:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([t.token_ids])).logits[0, :-1] / 0.8
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.token_ids[1:])[:, None])[:, 0]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        worst = max(worst, float((want[mask] - torch.tensor(t.logprobs[1:])[mask]).abs().max()))
    assert worst < 1e-4, worst
    # A fixed seed fixes the samples.
    again = run_episodes(workflow, engine, rows, 2, params)
    assert [t.token_ids for t in again] == [t.token_ids for t in trajectories]


def test_multi_turn_feedback_reward_discount_and_masks(chat: dict[str, Any]) -> None:
    tokenizer = chat["tokenizer"]
    config = WorkflowConfig(
        name="multi_turn", max_turns=3, chat_template=True, multi_turn=MultiTurnConfig(turn_discount=0.5, feedback="no")
    )
    workflow = build_workflow(config, tokenizer, lambda p, r, ref: float(r.strip() == ref))
    engine = ScriptedEngine(tokenizer, ["41", "42"])
    [t] = run_episodes(workflow, engine, _rows(tokenizer, ["q"]), 1, SamplingParams(max_new_tokens=4))
    assert t.stop_reason == "correct" and [turn.reward for turn in t.turns] == [0.0, 1.0]
    assert t.reward == 0.5, "a correct answer at the second turn is discounted once"
    text = tokenizer.decode(t.token_ids)
    assert (
        text
        == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n41<|im_end|>\n<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n42<|im_end|>"
    )
    generated = tokenizer.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m])
    assert generated == "41<|im_end|>42<|im_end|>", "only model tokens carry loss"
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "41"},
        {"role": "user", "content": "no"},
    ]
    rerendered = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    retokenised = tokenizer(rerendered, add_special_tokens=False)["input_ids"]
    assert retokenised != t.token_ids[: len(retokenised)], "the template is not prefix-stable; our ids are the engine's"


def _tool_episode(chat: dict[str, Any], script: list[str], **overrides: Any) -> Trajectory:
    tokenizer = chat["tokenizer"]
    config = WorkflowConfig(
        name="tool_use",
        max_turns=4,
        chat_template=True,
        tool_use=ToolUseConfig(tools=("calculator", "wf_user_mod:add", "wf_user_mod:broken"), **overrides),
    )
    workflow = build_workflow(config, tokenizer, lambda p, r, ref: float(r == ref))
    [t] = run_episodes(
        workflow, ScriptedEngine(tokenizer, script), _rows(tokenizer, ["6*7?"]), 1, SamplingParams(max_new_tokens=64)
    )
    return t


def test_tool_use_runs_tools_and_masks_their_results(chat: dict[str, Any]) -> None:
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    t = _tool_episode(chat, [call, "42"])
    assert t.stop_reason == "answer" and t.reward == 1.0 and t.tool_calls == 1 and t.tool_errors == []
    text = chat["tokenizer"].decode(t.token_ids)
    assert "<tool_response>42</tool_response>" in text and text.count("<|im_start|>assistant") == 2
    generated = chat["tokenizer"].decode([i for i, m in zip(t.token_ids, t.loss_mask) if m])
    assert "<tool_response>" not in generated and generated == call + "<|im_end|>42<|im_end|>"
    assert text.startswith("<|im_start|>system\ntools: calculator,add,broken"), "tool schemas reach the template"


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ("{not json", "malformed"),
        ('{"arguments": {}}', "malformed"),
        ('{"name": "search", "arguments": {}}', "unknown_tool"),
        ('{"name": "add", "arguments": {"a": 1}}', "bad_arguments"),
        ('{"name": "broken", "arguments": {"x": "y"}}', "exception"),
        ('{"name": "calculator", "arguments": {"expression": "__import__(1)"}}', "exception"),
    ],
)
def test_every_bad_tool_call_is_an_error_message_not_a_crash(chat: dict[str, Any], body: str, kind: str) -> None:
    t = _tool_episode(chat, [f"<tool_call>{body}</tool_call>", "42"])
    assert t.tool_errors == [kind] and t.stop_reason == "answer" and t.reward == 1.0
    assert "<tool_response>error: " in chat["tokenizer"].decode(t.token_ids)


def test_tool_timeout_and_max_turns(chat: dict[str, Any]) -> None:
    code = json.dumps({"name": "python", "arguments": {"code": "while True: pass"}})
    tools = load_tools(["python"])
    name, result = asyncio.run(run_tool_call(code, tools, timeout_s=0.5))
    assert name == "python" and result.error == "timeout" and "timed out after 0.5s" in result.content
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    t = _tool_episode(chat, [call] * 4)
    assert t.stop_reason == "max_turns" and t.reward == 0.0 and t.tool_calls == 4 and len(t.turns) == 4


def test_python_tool_limits_and_calculator() -> None:
    assert asyncio.run(python("print(6*7)")) == "42\n"
    with pytest.raises(RuntimeError, match="MemoryError"):
        asyncio.run(python("x = bytearray(2 * 1024**3)"))
    with pytest.raises(RuntimeError, match="network access is disabled"):
        asyncio.run(python("import socket; socket.create_connection(('example.com', 80))"))
    assert calculator("(2 + 3) * 4 - 6 / 3") == "18" and calculator("7 // 2") == "3"
    for bad in ("__import__('os')", "a + 1", "[1] * 3", "9 ** 99999"):
        with pytest.raises(ValueError):
            calculator(bad)
    schema = tool_schema(python)["function"]
    assert schema["name"] == "python" and list(schema["parameters"]["properties"]) == ["code"]
    assert schema["parameters"]["properties"]["code"] == {"type": "string"}


def test_registry_and_crashed_groups_are_dropped(chat: dict[str, Any]) -> None:
    assert {"rlvr", "multi_turn", "tool_use"} <= set(WORKFLOWS.names())
    with pytest.raises(ValueError, match="unknown workflow 'no_such_workflow'; registered"):
        WORKFLOWS.get("no_such_workflow")
    tokenizer = chat["tokenizer"]

    def reward(prompt: str, response: str, reference: str) -> float:
        if prompt == "bad":
            raise KeyError("boom")
        return 1.0

    workflow = build_workflow(WorkflowConfig(chat_template=True), tokenizer, reward)
    kept = run_episodes(
        workflow, ScriptedEngine(tokenizer, ["x"]), _rows(tokenizer, ["ok", "bad", "ok2"]), 2, SamplingParams()
    )
    assert [t.group for t in kept] == [0, 0, 2, 2] and kept.num_failed == 2 and kept.num_dropped == 2
    assert "reward function raised on prompt 'bad'" in kept.first_error


def test_trajectories_to_batch_masks_environment_tokens() -> None:
    t = Trajectory(group=0, token_ids=[], loss_mask=[], logprobs=[], versions=[])
    t.append([1, 2])
    t.append([3, 4], logprobs=[-0.1, -0.2], version=2)
    t.append([5])
    t.append([6], logprobs=[-0.3], version=3)
    batch = trajectories_to_batch([t], torch.tensor([1.5]))
    assert batch.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert batch.extras[ADVANTAGES].tolist() == [0, 0, 1.5, 1.5, 0, 1.5]
    assert torch.allclose(batch.extras[OLD_LOGPROBS], torch.tensor([0, 0, -0.1, -0.2, 0, -0.3]))
    assert t.version == 2 and Trajectory.from_state(json.loads(json.dumps(t.to_state()))) == t
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory(group=0, token_ids=[1], loss_mask=[], logprobs=[], versions=[])


def _grpo_config(chat: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    data = chat["root"] / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=?", "completion": str(2 * a)}) + "\n" for a in range(8)))
    base = {
        "model": chat["model"], "train_file": str(data), "output_dir": str(out), "layout": "d1", "steps": 3,
        "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "progress": False, "save_every": 2,
        "export_hf_at_end": False, "temperature": 0.9, "reward_fn": "wf_user_mod:has_digit",
        "workflow": {"name": "multi_turn", "max_turns": 3, "chat_template": True, "multi_turn": {"turn_discount": 0.5}},
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    return build_config(GRPOConfig, apply_overrides(base, [f"{k}={v}" for k, v in overrides.items()]))


def _records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_grpo_multi_turn_from_config_resumes_and_recomputes_behaviour_logprobs(
    chat: dict[str, Any], tmp_path: Path
) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    run_grpo(_grpo_config(chat, tmp_path / "a"))
    run_grpo(_grpo_config(chat, tmp_path / "b", steps=2))
    run_grpo(_grpo_config(chat, tmp_path / "b"))
    a, b = _records(tmp_path / "a"), _records(tmp_path / "b")
    for key in ("loss", "grad_norm", "reward_mean", "episode/turns"):
        assert a[2][key] == b[-1][key], key
    for record in a:
        assert record["behaviour_kl"] < 1e-4, record
        assert record["episode/turns"] > 1 and record["episodes_failed"] == 0
        assert (
            record["episode/stop/max_turns"] + record["episode/stop/max_tokens"] + record["episode/stop/correct"] == 1
        )
    assert a[-1]["grad_norm"] > 0


def test_grpo_fails_past_max_failed_fraction(chat: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    overrides = {"reward_fn": "wf_user_mod:broken", "steps": 1, "resume": "never", "workflow.max_failed_fraction": 0.5,
                 "reward.on_error": "raise"}  # fmt: skip
    with pytest.raises(RuntimeError, match=r"4 of 4 episodes crashed .*max_failed_fraction=0.5"):
        run_grpo(_grpo_config(chat, tmp_path / "f", **overrides))
    # The default (0) raises the episode's own error, as before workflows (no group is dropped).
    with pytest.raises(RuntimeError, match=r"^the reward function raised on prompt '\d\+\d=\?'"):
        run_grpo(_grpo_config(chat, tmp_path / "g", **(overrides | {"workflow.max_failed_fraction": 0})))
