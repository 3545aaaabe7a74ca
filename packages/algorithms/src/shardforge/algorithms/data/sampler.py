"""Deterministic global batches: the step is the position, so resume needs no sampler state."""

from __future__ import annotations

import torch

__all__ = ["GlobalBatchSampler"]


class GlobalBatchSampler:
    """Deterministic global batches over an infinite stream of shuffled epochs.

    Global batch ``k`` is items ``[k*B, (k+1)*B)`` of the concatenated per-epoch
    permutations; data-parallel rank ``r`` of ``n`` takes every n-th of them. The position
    is just the step, so a resumed run (with any data-parallel size) continues exactly.
    """

    def __init__(self, num_examples: int, global_batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_examples < 1:
            raise ValueError("the dataset is empty")
        if global_batch_size < 1:
            raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epochs: dict[int, list[int]] = {}

    def _epoch(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._epochs[epoch] = torch.randperm(self.num_examples, generator=gen).tolist()
            else:
                self._epochs[epoch] = list(range(self.num_examples))
            if len(self._epochs) > 2:
                self._epochs.pop(min(e for e in self._epochs if e != epoch))  # never the one just made
        return self._epochs[epoch]

    def global_batch(self, step: int) -> list[int]:
        start = step * self.global_batch_size
        return [
            self._epoch(i // self.num_examples)[i % self.num_examples]
            for i in range(start, start + self.global_batch_size)
        ]

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        if self.global_batch_size < dp_size:
            raise ValueError(
                f"global batch size {self.global_batch_size} is smaller than the data-parallel size {dp_size}; "
                f"use a batch size >= {dp_size}"
            )
        return self.global_batch(step)[dp_rank::dp_size]
