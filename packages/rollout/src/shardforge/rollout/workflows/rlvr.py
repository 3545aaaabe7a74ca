"""The RLVR workflow: one prompt -> one response -> the verifier's reward (single turn)."""

from __future__ import annotations

from typing import Any

from shardforge.rollout.episodes.request_queue import EpisodeHandle
from shardforge.rollout.episodes.trajectory import Trajectory, TurnInfo
from shardforge.rollout.workflows.base import PromptRow, WorkflowConfig, new_trajectory, score_in_batch
from shardforge.rollout.workflows.chat import ChatCodec

__all__ = ["RLVRWorkflow"]


class RLVRWorkflow:
    """Today's GRPO sampling as a workflow: the same prompt ids, the same samples, the same rewards."""

    def __init__(self, config: WorkflowConfig, tokenizer: Any, reward_fn: Any) -> None:
        self.reward_fn = reward_fn
        self.codec = ChatCodec(tokenizer, chat_template=config.chat_template, system_prompt=config.system_prompt)

    async def run_episode(self, engine: EpisodeHandle, row: PromptRow) -> list[Trajectory]:
        trajectory = new_trajectory(
            row, self.codec.prompt_ids(row.prompt, row.prompt_ids, rendered=row.images is not None)
        )
        out = await engine.generate(trajectory.token_ids)
        trajectory.append(out.response_ids, logprobs=out.logprobs, version=out.versions, routing=out.routed_experts)
        trajectory.reward = await score_in_batch(engine, self.reward_fn, row, out.text)
        trajectory.turns.append(
            TurnInfo(generated=len(out.response_ids), finished=out.finished, reward=trajectory.reward)
        )
        trajectory.stop_reason = "eos" if out.finished else "max_new_tokens"
        trajectory.text = out.text
        return [trajectory]
