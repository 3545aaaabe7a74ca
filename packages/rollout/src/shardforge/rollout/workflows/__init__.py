"""Workflows: (rollout engine, data row) -> trajectories. Built-ins ``rlvr``, ``multi_turn`` and
``tool_use`` are registered by name in `WORKFLOWS`; a user's class is named by import path.
See docs/packages/algorithms-workflows.md."""

from __future__ import annotations

from shardforge.rollout.episodes.request_queue import EpisodeHandle, RequestQueue
from shardforge.rollout.episodes.trajectory import Trajectory, TurnInfo
from shardforge.rollout.workflows.base import (
    WORKFLOWS,
    MultiTurnConfig,
    PromptRow,
    ToolUseConfig,
    Workflow,
    WorkflowConfig,
    build_workflow,
)
from shardforge.rollout.workflows.chat import ChatCodec
from shardforge.rollout.workflows.runner import EpisodeList, episode_counts, run_episodes
from shardforge.rollout.workflows.tools import TOOLS, Tool, ToolResult, tool_schema

__all__ = [
    "TOOLS",
    "WORKFLOWS",
    "ChatCodec",
    "EpisodeHandle",
    "EpisodeList",
    "MultiTurnConfig",
    "PromptRow",
    "RequestQueue",
    "Tool",
    "ToolResult",
    "ToolUseConfig",
    "Trajectory",
    "TurnInfo",
    "Workflow",
    "WorkflowConfig",
    "build_workflow",
    "episode_counts",
    "run_episodes",
    "tool_schema",
]
