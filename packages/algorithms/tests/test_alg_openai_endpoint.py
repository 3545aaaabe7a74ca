"""The OpenAI-compatible endpoint (issue 38) driven by the real ``openai`` client (pinned in constraints.txt).

The agent side is plain OpenAI client code; the recorded trajectories must be the engine's own ids, id for
id (a test here fails if anything re-encodes the conversation), with the engine's behaviour log-probs
(equal to teacher-forced ones under the same weights)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")

import httpx  # noqa: E402  (a dependency of openai)

from shardforge.algorithms.testing import QWEN3_TOOL_TEMPLATE, tiny_chat_assets  # noqa: E402
from shardforge.rollout.factory import build_rollout_engine  # noqa: E402
from shardforge.rollout.openai import OpenAIEndpoint  # noqa: E402

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "evaluate arithmetic",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    assets = tiny_chat_assets(tmp_path_factory.mktemp("endpoint"), seed=3, chat_template=QWEN3_TOOL_TEMPLATE)
    engine = build_rollout_engine("hf", assets["model"], assets["tokenizer"])
    server = OpenAIEndpoint(engine, assets["tokenizer"], model_name="tiny", max_tokens=24).start()
    yield server, assets
    server.stop()


def _client(server: OpenAIEndpoint, episode: str) -> Any:
    return openai.OpenAI(base_url=server.url, api_key=episode, max_retries=0)


def test_models_lists_the_served_model(endpoint: Any) -> None:
    server, _ = endpoint
    assert [m.id for m in _client(server, "e0").models.list().data] == ["tiny"]


def test_a_multi_turn_tool_chat_is_one_token_exact_trajectory(endpoint: Any) -> None:
    server, assets = endpoint
    tokenizer = assets["tokenizer"]
    client = _client(server, "ep-tools")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "12+30="}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR], max_tokens=12,
                                           temperature=1.0, seed=1, logprobs=True)  # fmt: skip
    choice = first.choices[0]
    raw = choice.model_extra or {}
    # The client gets vLLM's token-id fields; the prompt is the tokenizer's template over the messages.
    prompt_ids = first.model_extra["prompt_token_ids"]
    expected_prompt = tokenizer(
        tokenizer.apply_chat_template(messages, tools=[CALCULATOR], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    assert prompt_ids == expected_prompt
    completion_ids = raw["token_ids"]
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
        server.recorder.get("ep-tools").turns[0].logprobs
    )
    # The agent sends the conversation back (the assistant's own text, a tool result, a new user turn).
    messages += [{"role": "assistant", "content": choice.message.content or ""},
                 {"role": "user", "content": "and 5+5="}]  # fmt: skip
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR], max_tokens=8)
    record = server.recorder.pop("ep-tools")
    assert len(record.turns) == 2
    second_prompt = second.model_extra["prompt_token_ids"]
    generated = second.choices[0].model_extra["token_ids"]
    if second_prompt[: len(prompt_ids) + len(completion_ids)] == prompt_ids + completion_ids:
        # The template re-rendered the first completion into the same ids: one trajectory, mask 1 exactly on
        # the ids the engine generated, the new prompt tokens masked.
        assert record.rewrites == 0 and len(record.trajectories) == 1
        trajectory = record.trajectories[0]
        assert trajectory.token_ids == second_prompt + generated
        mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
        mask += [0] * (len(second_prompt) - len(prompt_ids) - len(completion_ids)) + [1] * len(generated)
        assert trajectory.loss_mask == mask
    else:  # the re-rendered history differs at the token level: a new trajectory, counted, never re-encoded
        assert record.rewrites == 1 and len(record.trajectories) == 2
        assert record.trajectories[0].token_ids == prompt_ids + completion_ids
        assert record.trajectories[1].token_ids == second_prompt + generated


def test_recorded_log_probs_are_the_teacher_forced_ones(endpoint: Any) -> None:
    from transformers import AutoModelForCausalLM

    server, assets = endpoint
    client = _client(server, "ep-lp")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "7+8="}], max_tokens=10,
                                   temperature=1.0, seed=5)  # fmt: skip
    turn = server.recorder.pop("ep-lp").turns[0]
    model = AutoModelForCausalLM.from_pretrained(assets["model"]).eval()
    ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(turn.prompt_ids) - 1 : -1].float()
    forced = torch.log_softmax(logits, -1).gather(-1, torch.tensor(turn.completion_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(turn.logprobs), forced, rtol=0, atol=1e-4)


def test_a_rewritten_history_starts_a_new_counted_trajectory(endpoint: Any) -> None:
    server, _ = endpoint
    client = _client(server, "ep-rw")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}], max_tokens=6)
    rewritten = [{"role": "user", "content": "2+2="}]  # the agent dropped and rewrote its history
    client.chat.completions.create(model="tiny", messages=rewritten, max_tokens=6)
    record = server.recorder.pop("ep-rw")
    assert record.rewrites == 1 and len(record.trajectories) == 2


def test_n_choices_stop_strings_and_completions(endpoint: Any) -> None:
    server, _ = endpoint
    client = _client(server, "ep-n")
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "3+4="}],
                                              max_tokens=8, n=3, temperature=1.0)  # fmt: skip
    assert len(response.choices) == 3
    record = server.recorder.pop("ep-n")
    assert len(record.trajectories) == 3  # each choice its own branch of the same prompt
    text = client.completions.create(model="tiny", prompt="12+", max_tokens=10, stop=["1", "2", "3", "4"])
    choice = text.choices[0]
    assert not any(s in choice.text for s in "1234")
    assert choice.finish_reason in ("stop", "length")


def test_streaming_yields_the_same_completion(endpoint: Any) -> None:
    server, _ = endpoint
    client = _client(server, "ep-stream")
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "9+9="}],
                                                 max_tokens=6, stream=True, seed=2))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None or any(c.choices and c.choices[0].finish_reason for c in chunks)
    turn = server.recorder.pop("ep-stream").turns[0]
    assert text == server.tokenizer.decode(
        [t for t in turn.completion_ids if t != server.tokenizer.eos_token_id], skip_special_tokens=True
    )


def test_64_concurrent_episodes_are_batched_and_recorded_apart(endpoint: Any) -> None:
    server, _ = endpoint

    async def one(i: int) -> None:
        client = openai.AsyncOpenAI(base_url=server.url, api_key=f"conc-{i}", max_retries=0)
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"{i}+1="}],
                                             max_tokens=5)  # fmt: skip
        await client.close()

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(64)))

    asyncio.run(main())
    for i in range(64):
        record = server.recorder.pop(f"conc-{i}")
        assert len(record.turns) == 1 and record.turns[0].prompt_ids


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 9}, 400, "temperature"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "top_logprobs"),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ],
)
def test_malformed_requests_get_openai_style_errors(endpoint: Any, payload: dict, status: int, param: str) -> None:
    server, _ = endpoint
    response = httpx.post(f"{server.url}/chat/completions", json=payload, headers={"Authorization": "Bearer e"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    with pytest.raises(openai.APIStatusError):
        _client(server, "e").chat.completions.create(**payload)


def test_a_request_without_an_episode_is_refused(endpoint: Any) -> None:
    server, _ = endpoint
    response = httpx.post(f"{server.url}/chat/completions", content=json.dumps({"messages": []}))
    assert response.status_code == 401 and "episode" in response.json()["error"]["message"]


def test_token_in_turns_merge_into_one_trajectory_with_the_engines_ids(endpoint: Any) -> None:
    """A client that sends the conversation back as token ids (``/v1/completions`` with a token prompt): every
    turn extends the previous prompt + completion, so the episode is one trajectory whose ids are exactly what the
    engine was fed and generated (mask 1 on generated ids only)."""
    server, assets = endpoint
    client = _client(server, "ep-ids")
    prompt = assets["tokenizer"]("12+30=", add_special_tokens=False)["input_ids"]
    ids, mask = list(prompt), [0] * len(prompt)
    for extra in ("?", "!"):
        response = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=1.0)
        generated = response.choices[0].model_extra["token_ids"]
        assert response.model_extra["prompt_token_ids"] == ids
        feedback = assets["tokenizer"](extra, add_special_tokens=False)["input_ids"]
        ids, mask = ids + generated + feedback, mask + [1] * len(generated) + [0] * len(feedback)
    record = server.recorder.pop("ep-ids")
    assert record.rewrites == 0 and len(record.trajectories) == 1
    trajectory = record.trajectories[0]
    assert trajectory.token_ids == ids[: len(trajectory.token_ids)] and len(trajectory.token_ids) == len(ids) - 1
    assert trajectory.loss_mask == mask[: len(trajectory.token_ids)]
    assert [lp for lp, m in zip(trajectory.logprobs, trajectory.loss_mask) if m] == [
        lp for turn in record.turns for lp in turn.logprobs
    ]


def test_the_recorder_merges_extensions_branches_choices_and_counts_rewrites() -> None:
    from shardforge.rollout.openai import EpisodeRecorder
    from shardforge.rollout.types import Rollout

    def out(ids: list[int], version: int = 3) -> Rollout:
        return Rollout(prompt_index=0, prompt_ids=[], response_ids=ids, logprobs=[-0.5] * len(ids), finished=True,
                       version=version)  # fmt: skip

    recorder = EpisodeRecorder()
    recorder.record("e", [1, 2], [out([5, 6]), out([7])])  # n=2: two branches
    recorder.record("e", [1, 2, 5, 6, 9], [out([8], version=4)])  # extends the first choice
    recorder.record("e", [1, 3], [out([4])])  # a rewritten history
    record = recorder.pop("e")
    assert record.rewrites == 1
    merged, branch, rewritten = record.trajectories
    assert merged.token_ids == [1, 2, 5, 6, 9, 8] and merged.loss_mask == [0, 0, 1, 1, 0, 1]
    assert merged.versions == [-1, -1, 3, 3, -1, 4]
    assert branch.token_ids == [1, 2, 7] and rewritten.token_ids == [1, 3, 4]


def test_serve_openai_serves_a_model_directory(endpoint: Any) -> None:
    import subprocess
    import sys
    import time

    from shardforge.mesh import free_port

    _, assets = endpoint
    port = free_port()
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "serve-openai", "--model", assets["model"],
               "--port", str(port), "--name", "tiny-served", "--max-tokens", "8"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="cli", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.3)
        assert [m.id for m in models.data] == ["tiny-served"]
        reply = client.chat.completions.create(model="tiny-served", messages=[{"role": "user", "content": "1+2="}])
        assert reply.usage.completion_tokens <= 8
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class _ScriptedEngine:
    """Returns fixed response ids (log-prob -1, version 3): makes the model write a tool call, or spell one."""

    version = 3

    def __init__(self, responses: list[list[int]]) -> None:
        self.responses = responses

    def generate(self, prompts: Any, params: Any) -> list[Any]:
        from shardforge.rollout.types import Rollout

        ids = self.responses.pop(0)
        return [Rollout(prompt_index=0, prompt_ids=list(prompts[0]), response_ids=ids, logprobs=[-1.0] * len(ids),
                        finished=True, version=self.version)]  # fmt: skip


def test_tool_calls_are_parsed_merged_across_the_tool_result_and_never_re_encoded(endpoint: Any) -> None:
    """Turn 1: the model writes a tool call exactly as the chat template renders one; the client gets
    ``tool_calls``, runs the tool and sends both back; the template's rendering of that history extends turn 1's
    ids, so the episode stays one trajectory. Turn 2: the model spells ``<tool_call>`` character by character,
    which re-encodes to the single added token: the recorder keeps the engine's ids, not the text's."""
    _, assets = endpoint
    tokenizer = assets["tokenizer"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "1+1?"}]
    call = {"name": "calculator", "arguments": {"expression": "1+1"}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
    before = tokenizer.apply_chat_template(messages, tools=[CALCULATOR], add_generation_prompt=True, tokenize=False)
    after = tokenizer.apply_chat_template([*messages, assistant], tools=[CALCULATOR], tokenize=False)
    # Qwen3's template opens the newest assistant turn with an empty think block that it drops from earlier
    # turns: a model that writes it would start a new trajectory at the next turn (counted). This one does not.
    text = after[len(before) :].removeprefix("<think>\n\n</think>\n\n").rstrip("\n")
    written = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert written[-1] == tokenizer.eos_token_id
    spelled = [tokenizer.convert_tokens_to_ids(ch) for ch in "ok <tool_call>"] + [tokenizer.eos_token_id]
    assert tokenizer("ok <tool_call>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] != spelled
    server = OpenAIEndpoint(_ScriptedEngine([written, spelled]), tokenizer, model_name="tiny").start()
    try:
        client = _client(server, "ep-call")
        first = client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR])
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        (tool_call,) = message.tool_calls
        assert tool_call.function.name == "calculator" and json.loads(tool_call.function.arguments) == call["arguments"]
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tool_call.id, "content": "2"}]  # fmt: skip
        second = client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR])
        assert second.choices[0].message.content == "ok <tool_call>"
    finally:
        server.stop()
    record = server.recorder.pop("ep-call")
    assert record.rewrites == 0 and len(record.trajectories) == 1
    (trajectory,) = record.trajectories
    assert trajectory.token_ids[-len(spelled) :] == spelled  # the engine's ids, not the re-encoded text's
    assert trajectory.token_ids[: len(second.model_extra["prompt_token_ids"])] == second.model_extra["prompt_token_ids"]
    assert sum(trajectory.loss_mask) == len(written) + len(spelled)
    assert trajectory.versions[-1] == 3 and trajectory.logprobs[-1] == -1.0
