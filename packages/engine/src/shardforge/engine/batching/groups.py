"""Micro-batches that keep groups of sequences together (e.g. a reward model's chosen/rejected pair).

A batch with a per-sequence extra ``sequence_group`` [N] (integer ids; sequences of one group
must be contiguous) is split by the engine with `grouped_microbatches`: whole groups are packed
first-fit-decreasing into the token budget, so a loss over groups (Bradley-Terry over pairs)
sees every member of a group in the same micro-batch. Ranks agree on the micro-batch count
exactly as `split_microbatches` does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardforge.engine.batching.microbatch import agree_max, ffd_bins
from shardforge.engine.batching.packed import PackedBatch

__all__ = ["SEQUENCE_GROUP", "group_units", "grouped_microbatches"]

SEQUENCE_GROUP = "sequence_group"
"""Per-sequence [N] extra: sequences with the same id stay in the same micro-batch."""


def group_units(groups: torch.Tensor) -> list[list[int]]:
    """Sequence indices of each group, in order; `ValueError` if a group is not contiguous."""
    ids = groups.tolist()
    units: list[list[int]] = []
    seen: set[int] = set()
    for i, g in enumerate(ids):
        if units and ids[units[-1][0]] == g:
            units[-1].append(i)
            continue
        if g in seen:
            raise ValueError(f"sequence group {g} is not contiguous (sequence {i}); put a group's sequences together")
        seen.add(g)
        units.append([i])
    return units


def grouped_microbatches(
    batch: PackedBatch, max_tokens: int, *, group: dist.ProcessGroup | None = None, min_count: int = 1
) -> list[tuple[list[int], PackedBatch | None]]:
    """Like `split_microbatches` (also ``min_count``), but never separates sequences of one ``sequence_group``."""
    groups = batch.extras[SEQUENCE_GROUP]
    if tuple(groups.shape) != (batch.num_sequences,):
        raise ValueError(
            f"extra {SEQUENCE_GROUP!r} must hold one id per sequence ({batch.num_sequences},), "
            f"got {tuple(groups.shape)}"
        )
    units = group_units(groups)
    lengths = batch.seq_lens
    unit_lengths = [sum(lengths[i] for i in u) for u in units]
    try:
        bins = ffd_bins(unit_lengths, max_tokens)
    except ValueError as err:
        raise ValueError(f"a sequence group does not fit one micro-batch: {err}") from None
    count = agree_max(max(len(bins), min_count), group)
    while len(bins) < count:  # split the fullest bin of >1 unit, else add empty micro-batches
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.extend([] for _ in range(count - len(bins)))
            break
        fullest = max(splittable, key=lambda b: sum(unit_lengths[u] for u in b))
        bins.remove(fullest)
        half = len(fullest) // 2
        bins.extend([fullest[:half], fullest[half:]])
    out: list[tuple[list[int], PackedBatch | None]] = []
    for b in bins:
        indices = [i for u in sorted(b) for i in units[u]]
        out.append((indices, batch.select(indices) if indices else None))
    return out
