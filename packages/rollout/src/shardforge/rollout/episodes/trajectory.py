"""The trajectory of one episode: exactly the token ids the rollout engine was fed and produced.

A trajectory is built token-in / token-out: the first prompt's ids, then per turn the ids the
engine generated (``loss_mask`` 1, their behaviour log-probs and the weight version that sampled
them) and the ids of whatever the environment appended (a tool result, a user turn, the chat
template's turn markers; ``loss_mask`` 0). Earlier turns are never re-tokenised from text, so the
trainer scores the very sequence the engine sampled, whatever the chat template does to history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from shardforge.rollout.types import ImageInputs

__all__ = ["Trajectory", "TurnInfo"]


@dataclass(kw_only=True, slots=True)
class TurnInfo:
    """What happened in one turn of an episode."""

    generated: int
    """Tokens the model generated in this turn."""
    finished: bool
    """True if the turn ended on EOS (False: cut at the turn's token budget)."""
    tool_calls: int = 0
    """Tool calls the model made in this turn."""
    tool_errors: list[str] = field(default_factory=list)
    """Error kind of every failed tool call (malformed, unknown_tool, bad_arguments, exception, timeout)."""
    reward: float | None = None
    """The verifier's reward of this turn's answer (None: not scored)."""


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One episode's token sequence with per-token training info (all lists have one entry per token)."""

    group: int
    """Index of the data row (prompt) in this rank's batch: trajectories of one group share it."""
    token_ids: list[int]
    """Prompt, generated tokens and environment tokens, in the order the engine saw them."""
    loss_mask: list[int]
    """1 on model-generated tokens, 0 on prompt / tool output / environment text."""
    logprobs: list[float]
    """Behaviour log-prob of every generated token (0.0 where ``loss_mask`` is 0)."""
    versions: list[int]
    """Weight version that generated each token (-1 where ``loss_mask`` is 0)."""
    reward: float = 0.0
    """The episode's scalar reward (what advantages are computed from)."""
    turns: list[TurnInfo] = field(default_factory=list)
    """One entry per model turn."""
    stop_reason: str = ""
    """Why the episode ended: answer, correct, max_turns, max_tokens, ..."""
    text: str = ""
    """Decoded text of the last model turn (for logs and evaluation)."""
    baseline_reward: float | None = None
    """ReMax: the (shaped) reward of the prompt's greedy episode, set by the trainer when advantage=remax."""
    routed_experts: Any = None
    """MoE router replay: [n, L, K] experts of the first n tokens (the last generate call's context and
    response, when it covered the whole trajectory so far; later environment tokens have none)."""
    images: ImageInputs | None = None
    """The images of the prompt (a vision-language model's image prompt; None: text only): the trainer's
    forward takes them with the trajectory's image tokens, as the rollout engine did."""

    def __post_init__(self) -> None:
        lengths = {len(self.token_ids), len(self.loss_mask), len(self.logprobs), len(self.versions)}
        if len(lengths) != 1:
            raise ValueError(
                f"trajectory lists differ in length: token_ids={len(self.token_ids)}, loss_mask={len(self.loss_mask)}, "
                f"logprobs={len(self.logprobs)}, versions={len(self.versions)}; every list has one entry per token"
            )

    def append(
        self,
        ids: list[int],
        *,
        logprobs: list[float] | None = None,
        version: int | Sequence[int] = -1,
        routing: Any = None,
    ) -> None:
        """Append environment tokens (``logprobs=None``: mask 0) or generated tokens (their log-probs).

        ``version``: the weight version of all generated tokens, or one per token (partial rollouts).

        ``routing``: the generate call's `Rollout.routed_experts` (its prompt + these tokens); kept when that
        prompt was this whole trajectory (router replay), else dropped."""
        self.token_ids += ids
        if routing is not None and len(routing) == len(self.token_ids):
            self.routed_experts = routing
        if logprobs is None:
            self.loss_mask += [0] * len(ids)
            self.logprobs += [0.0] * len(ids)
            self.versions += [-1] * len(ids)
        else:
            if len(logprobs) != len(ids):
                raise ValueError(f"{len(ids)} generated tokens but {len(logprobs)} log-probs")
            self.loss_mask += [1] * len(ids)
            self.logprobs += list(logprobs)
            versions = [version] * len(ids) if isinstance(version, int) else list(version)
            if len(versions) != len(ids):
                raise ValueError(f"{len(ids)} generated tokens but {len(versions)} weight versions")
            self.versions += versions

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def version(self) -> int:
        """The oldest weight version among the generated tokens (-1: none generated)."""
        generated = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(generated) if generated else -1

    @property
    def tool_calls(self) -> int:
        return sum(t.tool_calls for t in self.turns)

    @property
    def tool_errors(self) -> list[str]:
        return [kind for t in self.turns for kind in t.tool_errors]

    def to_state(self) -> dict[str, Any]:
        """JSON-able state (float32 log-probs round-trip exactly through Python floats)."""
        # tensors: stored as nested lists
        routed, images, self.routed_experts, self.images = self.routed_experts, self.images, None, None
        try:
            state = asdict(self)
        finally:
            self.routed_experts, self.images = routed, images
        state["routed_experts"] = routed.tolist() if routed is not None else None
        if images is not None:
            state["images"] = {
                "pixel_values": images.pixel_values.tolist(),
                "image_grid_thw": images.image_grid_thw.tolist(),
            }
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Trajectory:
        state = dict(state)
        import torch

        state["turns"] = [TurnInfo(**t) for t in state.get("turns", [])]
        if state.get("routed_experts") is not None:
            state["routed_experts"] = torch.tensor(state["routed_experts"], dtype=torch.int16)
        if state.get("images") is not None:
            images = state["images"]
            state["images"] = ImageInputs(
                torch.tensor(images["pixel_values"], dtype=torch.float32),
                torch.tensor(images["image_grid_thw"], dtype=torch.long),
            )
        return cls(**state)
