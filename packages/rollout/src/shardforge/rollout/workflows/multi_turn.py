"""The multi-turn workflow: answer; after a wrong answer the verifier's feedback comes back as a
user turn and the model tries again, up to ``max_turns`` (AReaL's multi-turn math workflow).

A correct answer at turn t (0-based) earns ``reward * turn_discount**t``; an episode that never
answers correctly earns its last answer's reward discounted the same way (0 for exact match).
"""

from __future__ import annotations

from typing import Any

from shardforge.rollout.episodes.request_queue import EpisodeHandle
from shardforge.rollout.episodes.trajectory import Trajectory, TurnInfo
from shardforge.rollout.workflows.base import PromptRow, WorkflowConfig, new_trajectory, score_in_batch
from shardforge.rollout.workflows.chat import ChatCodec

__all__ = ["MultiTurnWorkflow"]


class MultiTurnWorkflow:
    """Retry with feedback; token-in / token-out across turns (see `ChatCodec`)."""

    def __init__(self, config: WorkflowConfig, tokenizer: Any, reward_fn: Any) -> None:
        self.config, self.reward_fn = config, reward_fn
        self.codec = ChatCodec(tokenizer, chat_template=config.chat_template, system_prompt=config.system_prompt)

    async def run_episode(self, engine: EpisodeHandle, row: PromptRow) -> list[Trajectory]:
        config = self.config
        trajectory = new_trajectory(
            row, self.codec.prompt_ids(row.prompt, row.prompt_ids, rendered=row.images is not None)
        )
        trajectory.stop_reason = "max_turns"
        for turn in range(config.max_turns):
            out = await engine.generate(trajectory.token_ids)
            trajectory.append(out.response_ids, logprobs=out.logprobs, version=out.versions, routing=out.routed_experts)
            reward = await score_in_batch(engine, self.reward_fn, row, out.text)
            trajectory.turns.append(TurnInfo(generated=len(out.response_ids), finished=out.finished, reward=reward))
            trajectory.text = out.text
            trajectory.reward = reward * config.multi_turn.turn_discount**turn
            if reward > 0:
                trajectory.stop_reason = "correct"
                break
            if turn == config.max_turns - 1:
                break
            feedback = self.codec.continuation_ids(
                [{"role": "user", "content": config.multi_turn.feedback}], finished=out.finished
            )
            budget = config.max_total_tokens
            if budget is not None and len(trajectory.token_ids) + len(feedback) + engine.params.max_new_tokens > budget:
                trajectory.stop_reason = "max_tokens"
                break
            trajectory.append(feedback)
        return [trajectory]
