"""Rollout data types and the protocol every rollout engine implements."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "ImageInputs",
    "PromptSet",
    "ReceivesInProcess",
    "ReportsStats",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "SessionRolloutEngine",
    "Sleeps",
    "generate_rollouts",
]


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """The images of one prompt, as the image processor made them (in the order of their image tokens)."""

    pixel_values: torch.Tensor
    """[patches, C*t*p*p] of all images, in order."""
    image_grid_thw: torch.Tensor
    """[images, 3] int64 (t, h, w) patch grid of each image."""

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


@dataclass(frozen=True, slots=True)
class PromptSet:
    """Tokenised prompts with their reference answers (and, for a vision-language model, their images)."""

    texts: list[str]
    references: list[str]
    ids: list[list[int]]
    images: list[ImageInputs | None] | None = None
    """One entry per prompt (None: text prompts only): what the rollout engine and the trainer's forward
    take with the prompt's image tokens."""

    def __len__(self) -> int:
        return len(self.texts)

    def image(self, index: int) -> ImageInputs | None:
        """The images of prompt ``index`` (None without any)."""
        return self.images[index] if self.images is not None else None

    @staticmethod
    def concat(parts: Sequence[PromptSet]) -> PromptSet:
        """The prompts of ``parts`` one after the other."""
        images = None
        if any(p.images is not None for p in parts):
            images = [p.image(i) for p in parts for i in range(len(p))]
        return PromptSet(
            [t for p in parts for t in p.texts],
            [r for p in parts for r in p.references],
            [i for p in parts for i in p.ids],
            images,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How responses are sampled."""

    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    max_new_tokens: int = 16
    """Generation budget per response."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off). Behaviour log-probs are those of the full softmax at
    ``temperature``; keep top_p = 1 for unbiased PPO ratios."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens only (0 = off; applied before top_p, as HF's warpers). As
    with top_p, behaviour log-probs stay those of the full softmax."""
    seed: int | None = None
    """Seed of this generation call (None = the engine's running generator): prompt ``i``'s samples draw from
    ``rollout.seeds.request_seed(seed, i, n) + j``, so they depend on the prompt's position in the call."""
    seeds: tuple[int, ...] | None = None
    """Per-prompt seeds (one per prompt of the call; sample ``j`` of prompt ``i`` draws from ``seeds[i] + j``);
    set, they replace ``seed``: a request then samples the same in any call, batch or rank (`rollout.seeds`)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1 (samples per prompt)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        for i, seed in enumerate(self.seeds or ()):
            if not 0 <= seed < 2**63 - self.n:
                raise ValueError(f"seeds[{i}]={seed} must be in [0, 2**63 - n) (n={self.n}: seed + sample index)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    """One sampled response to one prompt."""

    prompt_index: int
    """Index of the prompt in the generate call."""
    prompt_ids: list[int]
    response_ids: list[int]
    """Generated tokens, including the EOS token when generation stopped on it."""
    logprobs: list[float]
    """Behaviour log-prob of every response token under the sampling distribution."""
    finished: bool
    """True if generation ended with EOS (False: truncated at max_new_tokens)."""
    version: int
    """Weight version that generated it (partial rollouts: the oldest of `token_versions`)."""
    text: str = ""
    """Decoded response (without special tokens)."""
    extras: dict[str, float] = field(default_factory=dict)
    routed_experts: Any = None
    """MoE router replay: [len(prompt_ids) + len(response_ids), L, K] int16 experts each token was routed to
    per MoE layer (-1 where the engine never ran the token, e.g. the last generated one); None when not recorded."""
    token_versions: list[int] | None = None
    """Partial rollouts: the weight version that generated each response token (an interrupted generation is
    continued under newer weights); None = every token has `version`."""

    @property
    def versions(self) -> list[int]:
        """The weight version of every response token."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.version] * len(self.response_ids)


class RolloutEngine(Protocol):
    """Generates responses with some weight version; refreshed after every optimiser step."""

    @property
    def version(self) -> int: ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        """``len(prompts) * params.n`` rollouts, grouped by prompt (prompt 0's n samples first).

        An engine that serves vision-language models also takes ``images=`` (one `ImageInputs` or None
        per prompt) and says so with a true ``accepts_images`` attribute (see `generate_rollouts`)."""
        ...

    def update_weights(self, version: int | None = None) -> int:
        """Switch to ``version`` (None = the newest published one); return the serving version."""
        ...


def generate_rollouts(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    images: Sequence[ImageInputs | None] | None = None,
) -> list[Rollout]:
    """``engine.generate(prompts, params)``, with ``images=`` when any prompt has images; an engine without
    ``accepts_images`` is then a `ValueError` (text-only engines keep the two-argument ``generate``)."""
    if images is None or all(i is None for i in images):
        return engine.generate(prompts, params)
    if not getattr(engine, "accepts_images", False):
        raise ValueError(
            f"{type(engine).__name__} cannot generate from image prompts; the embedded HF engine can "
            "(rollout.engine=hf; docs/packages/algorithms-vlm.md)"
        )
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} image entries (one per prompt, None: no images)")
    generate: Any = engine.generate
    rollouts: list[Rollout] = generate(prompts, params, images=images)
    return rollouts


@runtime_checkable
class SessionRolloutEngine(RolloutEngine, Protocol):
    """A rollout engine that keeps state per session between calls (the embedded HF engine: a multi-turn
    episode's KV cache, so a turn prefills only the tokens it adds). The workflows' request queue passes
    each episode as a session and ends it when the episode ends."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        sessions: Sequence[Hashable | None] | None = None,
    ) -> list[Rollout]:
        """As `RolloutEngine.generate`; ``sessions``: one key per prompt (``params.n`` = 1)."""
        ...

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        """Forget the state of ``sessions``."""
        ...


@runtime_checkable
class ReportsStats(Protocol):
    """A rollout engine that counts what happened since the last call (a server's health checks, failures,
    restarts; a Ray pool's dropped actors): the trainer sums them over its ranks into the step's metrics."""

    def pop_stats(self) -> dict[str, float]:
        """Counts since the last call (same keys on every rank), then zero."""
        ...


@runtime_checkable
class Sleeps(Protocol):
    """A rollout engine that can free its weights and KV caches between generation phases (``rollout.sleep``);
    the next published version it receives brings them back."""

    def sleep(self) -> object:
        """Free the weights and KV caches until the next weight version arrives."""
        ...


@runtime_checkable
class ReceivesInProcess(Protocol):
    """A rollout engine in the trainer's own processes that takes new weights through a `WeightReceiver`
    (``receiver``): the trainer may publish to it in memory instead of through disk (`publish.InProcessPublisher`)."""

    @property
    def receiver(self) -> Any: ...
