"""The OpenAI-compatible endpoint in front of vLLM (in-process and server), driven by the real ``openai`` client.

Runs only in ``nox -s vllm``. The endpoint (`shardforge.rollout.openai`) is engine-agnostic; this checks the
issue 38 guarantee on the vLLM engines: what an agent's chat turns are recorded as is vLLM's own ids, id for
id (the prompt ids the client gets back are the template's over the messages; the completion ids are what vLLM
generated), and the behaviour log-probs vLLM returned equal the HF model's teacher-forced ones over those ids
(gap < 1e-4, as in test_vllm_rollout.py). Concurrent episodes are recorded apart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

import torch  # noqa: E402

from shardforge.rollout import RolloutConfig, VLLMOptions, build_rollout_engine  # noqa: E402
from shardforge.rollout.openai import OpenAIEndpoint  # noqa: E402

LOGPROB_ATOL = 1e-4  # float32 on both sides, different kernels (measured gaps ~1e-6 in test_vllm_rollout.py)
TURNS, EPISODES = 3, 12


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_chat_assets

    # hidden 128 -> head_dim 32, which vLLM's CPU attention supports
    return tiny_chat_assets(tmp_path_factory.mktemp("vllm-endpoint"), hidden=128, layers=2, seed=3)


async def _episode(client: Any, index: int) -> list[dict[str, Any]]:
    """A plain OpenAI-client agent: ``TURNS`` turns, each answer sent back as the assistant's text."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{index}+{index + 7}="}]
    replies = []
    for _ in range(TURNS):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=8, temperature=1.0, seed=index, logprobs=True
        )
        replies.append(reply.model_dump())
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": "Wrong, try again."}]  # fmt: skip
    return replies


def _teacher_forced(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


def _check(chat: dict[str, Any], engine: Any) -> None:
    from transformers import AutoModelForCausalLM

    server = OpenAIEndpoint(engine, chat["tokenizer"], model_name="policy", max_tokens=8).start()
    try:

        async def run_all() -> list[list[dict[str, Any]]]:
            clients = [
                openai.AsyncOpenAI(base_url=server.url, api_key=f"ep-{i}", max_retries=0) for i in range(EPISODES)
            ]
            return await asyncio.gather(*(_episode(client, i) for i, client in enumerate(clients)))

        episodes = asyncio.run(run_all())
        records = [server.recorder.pop(f"ep-{i}") for i in range(EPISODES)]
    finally:
        server.stop()
    model = AutoModelForCausalLM.from_pretrained(chat["model"]).eval()
    for replies, record in zip(episodes, records, strict=True):
        assert len(record.turns) == TURNS
        for reply, turn in zip(replies, record.turns, strict=True):
            # What the client was told it sent and got is what was recorded: the engine's ids, never re-encoded.
            assert turn.prompt_ids == reply["prompt_token_ids"]
            assert turn.completion_ids == reply["choices"][0]["token_ids"]
            returned = [entry["logprob"] for entry in reply["choices"][0]["logprobs"]["content"]]
            assert returned == pytest.approx(turn.logprobs)
            gap = (torch.tensor(turn.logprobs) - _teacher_forced(model, turn.prompt_ids, turn.completion_ids)).abs()
            assert gap.max().item() < LOGPROB_ATOL, gap.max().item()
        # The trajectory trained is the last turn's ids as vLLM saw and produced them; a turn whose history did not
        # extend the previous ids at the token level started a new one, counted.
        last, final = record.trajectories[-1], record.turns[-1]
        assert last.token_ids == final.prompt_ids + final.completion_ids
        assert len(record.trajectories) == 1 + record.rewrites
        generated = [t for t, m in zip(last.token_ids, last.loss_mask, strict=True) if m]
        assert generated[-len(final.completion_ids) :] == final.completion_ids
    # Episodes were recorded apart: no episode's turns carry another episode's prompt.
    for index, record in enumerate(records):
        first_prompt = chat["tokenizer"].decode(record.turns[0].prompt_ids)
        assert f"{index}+{index + 7}=" in first_prompt


def test_endpoint_on_vllm_in_process(chat: dict[str, Any], tmp_path: Path) -> None:
    engine = build_rollout_engine(
        RolloutConfig(engine="vllm", vllm=VLLMOptions(max_num_seqs=16)), chat["model"], chat["tokenizer"]
    )
    try:
        _check(chat, engine)
    finally:
        engine.shutdown()


def test_endpoint_on_a_vllm_server(chat: dict[str, Any], tmp_path: Path) -> None:
    options = VLLMOptions(mode="server", max_num_seqs=16)
    engine = build_rollout_engine(RolloutConfig(engine="vllm", vllm=options), chat["model"], chat["tokenizer"])
    try:
        _check(chat, engine)
    finally:
        engine.shutdown()
