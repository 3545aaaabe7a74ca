"""Weighted mixtures of sources: deterministic, seeded interleaving with a resumable position per source.

Global batch ``k`` draws, for each of its ``B`` slots, a source with probability proportional to its
weight (a generator seeded by ``(seed, k)``, so the choice depends only on the step), then takes that
source's next item from its own infinite stream of shuffled epochs. The per-source positions are the
sampler's state: the trainer saves them in the checkpoint and restores them on resume, so a resumed
run draws exactly the batches an uninterrupted one would have, and a resume with changed weights
continues every source where it stopped (no repeats, nothing skipped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardforge.algorithms.data.sampler import GlobalBatchSampler

__all__ = ["MixtureSampler", "check_weights"]

_SOURCE_SEED_STRIDE = 1_000_003
"""Separates the sources' shuffle seeds (a source's epoch e uses seed + stride * (i + 1) + e)."""


def check_weights(weights: Sequence[float], names: Sequence[str]) -> None:
    """Refuse negative, non-finite or all-zero weights with a message that names them."""
    bad = [f"{n}={w!r}" for n, w in zip(names, weights) if not math.isfinite(w) or w < 0]
    if bad:
        raise ValueError(f"data.mix weights must be finite and >= 0; got {', '.join(bad)}")
    if not sum(weights) > 0:
        shown = ", ".join(f"{n}={w}" for n, w in zip(names, weights))
        raise ValueError(
            f"data.mix weights sum to {sum(weights)} ({shown}); they must sum to a positive number: "
            "give at least one source a weight > 0"
        )


class MixtureSampler:
    """Global batches of ``(source_index, row_index)`` over weighted sources; see the module docstring.

    ``state_dict``/``load_state_dict`` carry the next step and each source's position (JSON-friendly,
    keyed by source name). Batches must be asked for in step order; asking for a later step advances
    (replays) the draws in between, asking for an earlier one replays from step 0.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float],
        global_batch_size: int,
        *,
        names: Sequence[str] | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        names = list(names) if names is not None else [str(i) for i in range(len(sizes))]
        if not (len(sizes) == len(weights) == len(names)) or not sizes:
            raise ValueError(
                f"need one size, weight and name per source; got {len(sizes)}, {len(weights)}, {len(names)}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"mixture source names must be unique (set name: ...); got {names}")
        check_weights(weights, names)
        if global_batch_size < 1:
            raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
        self.names = names
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._probs = torch.tensor([float(w) for w in weights], dtype=torch.float64)
        self._streams = [
            GlobalBatchSampler(n, 1, seed=seed + _SOURCE_SEED_STRIDE * (i + 1), shuffle=shuffle)
            for i, n in enumerate(sizes)
        ]
        self.step = 0
        self.positions = [0] * len(sizes)

    def _choices(self, step: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_000_007 + step)
        return torch.multinomial(self._probs, self.global_batch_size, replacement=True, generator=gen).tolist()

    def _advance(self) -> list[tuple[int, int]]:
        batch = []
        for source in self._choices(self.step):
            batch.append((source, self._streams[source].global_batch(self.positions[source])[0]))
            self.positions[source] += 1
        self.step += 1
        return batch

    def global_batch(self, step: int) -> list[tuple[int, int]]:
        """The ``(source, row)`` pairs of global batch ``step`` (advances the state past it)."""
        if step < self.step:
            self.step, self.positions = 0, [0] * len(self.positions)
        while self.step < step:
            self._advance()
        return self._advance()

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> list[tuple[int, int]]:
        if self.global_batch_size < dp_size:
            raise ValueError(
                f"global batch size {self.global_batch_size} is smaller than the data-parallel size {dp_size}; "
                f"use a batch size >= {dp_size}"
            )
        return self.global_batch(step)[dp_rank::dp_size]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "positions": dict(zip(self.names, self.positions))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step and positions; a source the state does not know starts at 0 (a new source)."""
        saved = state.get("positions", {})
        self.step = int(state["step"])
        self.positions = [int(saved.get(name, 0)) for name in self.names]
