"""Micro-batches by token budget (first-fit-decreasing), same count on every DP rank.

FSDP all-gathers and reduce-scatters once per forward/backward, so every data-parallel
rank must run the same number of micro-batches or the collectives deadlock. Each rank
packs its sequences into as few bins as the budget allows, the ranks agree on the
maximum count, and ranks with fewer bins split their fullest bins (or, with fewer
sequences than the count, add empty micro-batches that contribute zero loss).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from shardforge.engine.batching.packed import PackedBatch
from shardforge.mesh.collectives import all_reduce_max

__all__ = ["agree_max", "ffd_bins", "split_microbatches"]


def ffd_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group sequence indices into bins of at most ``budget`` tokens, first-fit-decreasing.

    Bins are returned with their indices in original order, bins ordered by first index.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > budget]
    if too_long:
        i, n = too_long[0]
        raise ValueError(
            f"sequence {i} has {n} tokens, more than the micro-batch token budget {budget} "
            f"({len(too_long)} sequence(s) too long); raise max_tokens_per_microbatch to >= {max(lengths)} "
            "or truncate sequences (max_seq_len)"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.extend([] for _ in range(count - len(bins)))
            break
        fullest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(fullest)
        half = len(fullest) // 2
        bins.extend([fullest[:half], fullest[half:]])
    return bins


def agree_max(value: int, group: dist.ProcessGroup | None) -> int:
    """Max of ``value`` over ``group`` (identity without a process group)."""
    [agreed] = all_reduce_max(value, group=group)
    return int(agreed)


def split_microbatches(
    batch: PackedBatch,
    max_tokens: int,
    *,
    group: dist.ProcessGroup | None = None,
    min_count: int = 1,
) -> list[tuple[list[int], PackedBatch | None]]:
    """Split ``batch`` into micro-batches of at most ``max_tokens`` tokens.

    Returns ``(sequence indices, micro-batch)`` pairs, as many as the ranks of ``group``
    agreed on; a ``None`` micro-batch is an empty one this rank must still run (as a
    zero-loss dummy) to keep collectives matched.
    """
    lengths = batch.seq_lens
    bins = ffd_bins(lengths, max_tokens)
    count = agree_max(max(len(bins), min_count), group)
    bins = _split_to_count(bins, lengths, count)
    return [(b, batch.select(b) if b else None) for b in bins]
