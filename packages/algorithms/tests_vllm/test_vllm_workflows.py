"""Multi-turn episodes on vLLM (in-process and server): token-in / token-out across turns.

Runs only in ``nox -s vllm``. The chat model of the workflow tests (`testing.tiny_chat_assets`:
character tokenizer with Qwen3 chat markers and a template that is not prefix-stable; hidden 128,
head_dim 32 for vLLM's CPU attention) runs the ``multi_turn`` workflow for 3 turns (a reward that is
never right, so every episode gets the feedback turn twice). Each turn is a new vLLM request whose
prompt is the trajectory's token ids so far, never re-tokenised text. Checked per engine mode:

* the trainer's log-probs of every generated token, recomputed over the trajectory's ids, equal the
  behaviour log-probs vLLM returned (gap < 1e-4: the ids vLLM continued from are the ids trained on);
  A re-tokenised context would give vLLM's log-probs another context than the trainer's: they would
  differ far beyond the tolerance (the template is not prefix-stable, so re-tokenising changes ids);
* every trajectory starts with the rendered prompt's ids and has exactly 3 generated runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
from shardforge.engine import TrainEngine
from shardforge.engine.config import EngineConfig
from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
from shardforge.rollout import RolloutConfig, SamplingParams, VLLMOptions, build_rollout_engine
from shardforge.rollout.workflows.base import PromptRow, WorkflowConfig
from shardforge.rollout.workflows.multi_turn import MultiTurnWorkflow
from shardforge.rollout.workflows.runner import run_episodes

LOGPROB_ATOL = 1e-4  # float32 on both sides, different kernels: measured gaps ~1e-6 (see test_vllm_rollout.py)
TURNS, MAX_NEW = 3, 8


def never_right(prompt: str, response: str, reference: str) -> float:
    return 0.0


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_chat_assets

    assets = tiny_chat_assets(tmp_path_factory.mktemp("vllm-workflows"), hidden=128, layers=2, seed=3)
    config = WorkflowConfig(name="multi_turn", max_turns=TURNS, chat_template=True)
    workflow = MultiTurnWorkflow(config, assets["tokenizer"], never_right)
    rows = [PromptRow(index=i, prompt=f"{i}+{i + 7}=", reference=str(2 * i + 7), prompt_ids=[]) for i in range(4)]
    return {**assets, "workflow": workflow, "rows": rows}


def _check_engine(chat: dict[str, Any], engine: Any, tmp_path: Path) -> None:
    workflow, rows = chat["workflow"], chat["rows"]
    sampled = run_episodes(workflow, engine, rows, 2, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, seed=11))
    assert len(sampled) == 8 and all(len(t.turns) == TURNS for t in sampled)
    # 3 model turns separated by 2 feedback turns: the loss mask has exactly 3 generated runs.
    for t in sampled:
        mask = torch.tensor(t.loss_mask)
        assert int(mask.sum()) == sum(turn.generated for turn in t.turns)
        assert int(((mask[1:] == 1) & (mask[:-1] == 0)).sum()) + int(mask[0] == 1) == TURNS
    batch = trajectories_to_batch(sampled, torch.zeros(len(sampled)))
    trainer = TrainEngine(chat["model"], "d1", EngineConfig(max_tokens_per_microbatch=2048))
    trainer.logprob_temperature = 0.7
    targets = batch.loss_mask != 0
    gap = (trainer.forward(batch)[targets] - batch.extras[BEHAVIOUR_LOGPROBS][targets]).abs().max().item()
    assert gap < LOGPROB_ATOL, gap
    # The feedback turns are the codec's ids, appended after each answer as the engine returned it.
    codec = workflow.codec
    for t, row in zip(sampled, [r for r in rows for _ in range(2)]):
        prompt = codec.prompt_ids(row.prompt, row.prompt_ids)
        assert t.token_ids[: len(prompt)] == prompt


def test_multi_turn_episodes_in_process(chat: dict[str, Any], tmp_path: Path) -> None:
    engine = build_rollout_engine(
        RolloutConfig(engine="vllm", vllm=VLLMOptions(max_num_seqs=16)), chat["model"], chat["tokenizer"]
    )
    try:
        _check_engine(chat, engine, tmp_path)
    finally:
        engine.shutdown()


def test_multi_turn_episodes_on_a_server(chat: dict[str, Any], tmp_path: Path) -> None:
    options = VLLMOptions(mode="server", max_num_seqs=16)
    engine = build_rollout_engine(RolloutConfig(engine="vllm", vllm=options), chat["model"], chat["tokenizer"])
    try:
        _check_engine(chat, engine, tmp_path)
    finally:
        engine.shutdown()
