"""The training sources of any trainer, loaded and sampled one way: each source's rows become items
(SFT examples, preference pairs, prompts) through the trainer's own loader, the items are concatenated
in source order, and global batches are drawn by a `GlobalBatchSampler` (one source) or a
`MixtureSampler` (``data.mix``), both as indices into the concatenation.

A trainer keeps three things in step with its checkpoint: `SourceSet.data_state` (what decides the
order: a resume with other sources or sizes is refused), `SourceSet.extra_state` (the mixture's
per-source positions) and `SourceSet.restore`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from shardforge.algorithms.data.mixture import MixtureSampler
from shardforge.algorithms.data.sampler import GlobalBatchSampler
from shardforge.algorithms.data.sources import SourceConfig, is_plain_jsonl

__all__ = ["IndexSampler", "MixtureIndices", "SourceSet", "batch_sampler", "loader_arg"]

T = TypeVar("T")


class IndexSampler(Protocol):
    """Global batch ``step`` as indices into the concatenated items; rank ``r`` of ``n`` takes its share."""

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> list[int]: ...


def loader_arg(source: SourceConfig) -> str | SourceConfig:
    """What a row loader reads: a bare local .jsonl path as the path (errors as ``file:line``, as before
    sources existed), anything else as the `SourceConfig` (errors as ``<name> row <n>``)."""
    return source.source if is_plain_jsonl(source) else source


class MixtureIndices:
    """A `MixtureSampler` whose batches are indices into the concatenated sources (not ``(source, row)``)."""

    def __init__(self, mixture: MixtureSampler, sizes: Sequence[int]) -> None:
        self.mixture = mixture
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        return [self.offsets[s] + row for s, row in self.mixture.local_batch(step, dp_rank, dp_size)]

    def state_dict(self) -> dict[str, Any]:
        return self.mixture.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mixture.load_state_dict(state)


def batch_sampler(
    sources: Sequence[SourceConfig], sizes: Sequence[int], global_batch_size: int, *, seed: int, mix: bool
) -> GlobalBatchSampler | MixtureIndices:
    """The sampler of ``sources`` (``sizes`` items each): weighted by their ``weight`` when ``mix``, else
    uniform over the concatenation."""
    if mix:
        names, weights = [s.label for s in sources], [s.weight for s in sources]
        return MixtureIndices(MixtureSampler(sizes, weights, global_batch_size, names=names, seed=seed), sizes)
    return GlobalBatchSampler(sum(sizes), global_batch_size, seed=seed)


class SourceSet(Generic[T]):
    """The items of a trainer's training sources and the sampler of its global batches (module docstring)."""

    def __init__(
        self,
        sources: Sequence[SourceConfig],
        load: Callable[[str | SourceConfig], list[T]],
        global_batch_size: int,
        *,
        seed: int,
        mix: bool,
    ) -> None:
        if not sources:
            raise ValueError("no training source: set train_file, data.train or data.mix")
        per_source = [load(loader_arg(s)) for s in sources]
        self.sources = list(sources)
        self.names = [s.label for s in sources]
        self.sizes = [len(items) for items in per_source]
        self.items: list[T] = [item for items in per_source for item in items]
        self.per_source = per_source
        self.sampler = batch_sampler(sources, self.sizes, global_batch_size, seed=seed, mix=mix)

    @property
    def label(self) -> str:
        """The sources' names, for messages (``a.jsonl`` or ``math, chat``)."""
        return ", ".join(self.names)

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        return self.sampler.local_batch(step, dp_rank, dp_size)

    def data_state(self) -> dict[str, Any]:
        """``num_examples``, and for a mixture each source's size (weights may change on resume: each
        source continues at its saved position; the sources may not)."""
        state: dict[str, Any] = {"num_examples": len(self.items)}
        if isinstance(self.sampler, MixtureIndices):
            state["mixture_sources"] = dict(zip(self.names, self.sizes))
        return state

    def extra_state(self) -> dict[str, Any]:
        return {"mixture": self.sampler.state_dict()} if isinstance(self.sampler, MixtureIndices) else {}

    def restore(self, restored: dict[str, Any]) -> None:
        if isinstance(self.sampler, MixtureIndices) and "mixture" in restored:
            self.sampler.load_state_dict(restored["mixture"])
