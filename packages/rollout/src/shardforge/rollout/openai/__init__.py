"""An OpenAI-compatible endpoint in front of our rollout engines that records exact tokens per episode
(docs/agents-openai.md). Needs the ``openai`` extra (fastapi, uvicorn)."""

from shardforge.rollout.openai.recorder import EpisodeRecord, EpisodeRecorder, Turn
from shardforge.rollout.openai.server import OpenAIEndpoint

__all__ = ["EpisodeRecord", "EpisodeRecorder", "OpenAIEndpoint", "Turn"]
