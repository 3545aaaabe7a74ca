"""Shared prompt prefixes: a micro-batch of group samples holds each prompt once.

GRPO samples n completions per prompt, DPO pairs a chosen and a rejected answer to one prompt, a
system prompt opens every chat: consecutive sequences of a packed batch often begin with the same
tokens that are not training targets. Training runs every layer on every token, so those tokens are
computed n times. `share_prefixes` keeps them once: a sequence whose first P tokens equal those of the
latest sequence kept whole (its *source*), none of them a target, keeps only its tokens from P-1 on
(the last shared token stays: its output predicts the first target) with their positions (P-1, P, ...),
and its ``prefixes`` row points attention at the source's first P-1 tokens (the packed attention's
``prefixes``, `shardforge.ulysses_cp.packed_sdpa`). Each kept token sees exactly the context it saw
before, so every output is the unshared one (up to float summation order) and the weights' gradients
are the same sums: the shared tokens' keys and values collect the gradients of every sequence that
reads them.

`unshare_outputs` maps per-token outputs of the shared batch back to the original tokens (a dropped
token takes the output of the source token at its position: the same context). Per-sequence extras
and the sequence count are unchanged, so losses and their per-sequence aggregations run on the shared
batch as they are.

Legend: T = tokens, N = sequences, P = shared prefix length of a sequence.
"""

from __future__ import annotations

import itertools

import torch

from shardforge.engine.batching.packed import PackedBatch, cu_seqlens_of

__all__ = ["MIN_SHARED_TOKENS", "share_prefixes", "unshare_outputs"]

MIN_SHARED_TOKENS = 4
"""Share a prefix only when it removes at least this many tokens (shorter ones cost an extra
attention call for little)."""


def _shared_length(batch: PackedBatch, source: tuple[int, int], seq: tuple[int, int]) -> int:
    """P: how many leading tokens ``seq`` shares with ``source`` (ids and positions), none a target of ``seq``."""
    (s0, s1), (q0, q1) = source, seq
    n = min(s1 - s0, q1 - q0)
    same = (batch.input_ids[s0 : s0 + n] == batch.input_ids[q0 : q0 + n]) & (
        batch.position_ids[s0 : s0 + n] == batch.position_ids[q0 : q0 + n]
    )
    same &= batch.loss_mask[q0 : q0 + n] == 0  # a shared token is never a target of the sequence it serves
    differs = (~same).nonzero()
    return int(differs[0, 0]) if differs.numel() else n


def _heads(batch: PackedBatch, bounds: list[int], n: int) -> list[tuple[tuple[int, ...], ...] | None]:
    """Each sequence's first ``n`` (ids, positions), or None when it is shorter; one host copy per tensor."""
    ids, pos = batch.input_ids.tolist(), batch.position_ids.tolist()
    return [
        (tuple(ids[a : a + n]), tuple(pos[a : a + n])) if b - a >= n else None for a, b in itertools.pairwise(bounds)
    ]


def share_prefixes(batch: PackedBatch, min_shared: int = MIN_SHARED_TOKENS) -> PackedBatch:
    """``batch`` with each sequence's shared prefix held once (see the module); ``batch`` itself when
    nothing is shared. Per-token extras (leading size T) follow the kept tokens; per-sequence ones stay."""
    if batch.prefixes is not None:
        raise ValueError("share_prefixes() on a batch that already shares prefixes")
    bounds = batch.cu_seqlens.tolist()
    spans = list(itertools.pairwise(bounds))
    heads = _heads(batch, bounds, min_shared + 1)
    # pass 1 (cheap, no tensors): which sequences share how much with which source (None: kept whole)
    shared: list[tuple[int, int] | None] = []  # (source's sequence index, P) per sequence
    source: int | None = None  # the latest sequence kept whole
    for i, (start, end) in enumerate(spans):
        length = 0
        # a sequence that shares >= min_shared + 1 tokens with the source shares them with its predecessor
        # too (the source or another of its dependents): only then compare with the source token by token
        if source is not None and heads[i] is not None and heads[i] == heads[i - 1]:
            length = _shared_length(batch, spans[source], (start, end))
        if source is not None and length - 1 >= min_shared:
            shared.append((source, length))
        else:
            shared.append(None)
            source = i if end > start else source
    if all(entry is None for entry in shared):
        return batch  # the common case outside group sampling: no tensor work
    # pass 2: keep tokens P-1.. of each dependent; its prefix row points at the source's first P-1 tokens
    lengths = [end - start - (entry[1] - 1 if entry else 0) for (start, end), entry in zip(spans, shared, strict=True)]
    cu = cu_seqlens_of(lengths)
    new_starts = cu[:-1].tolist()
    keep: list[int] = []  # token index lists: one tensor each at the end (per-sequence tensor ops cost more)
    back: list[int] = []
    prefixes: list[tuple[int, int]] = []
    for (_, end), entry, new_start, length in zip(spans, shared, new_starts, lengths, strict=True):
        keep.extend(range(end - length, end))
        if entry is None:
            back.extend(range(new_start, new_start + length))
            prefixes.append((0, 0))
            continue
        source_start, count = new_starts[entry[0]], entry[1] - 1
        prefixes.append((source_start, count))
        # a dropped token, and the kept last shared one (its output is the source's), take the source's output
        back.extend(range(source_start, source_start + count + 1))
        back.extend(range(new_start + 1, new_start + length))
    token_index = torch.tensor(keep, dtype=torch.long)
    unshared = torch.tensor(back, dtype=torch.long)
    extras = {k: (v[token_index] if v.shape[0] == batch.num_tokens else v) for k, v in batch.extras.items()}
    return PackedBatch(
        input_ids=batch.input_ids[token_index],
        position_ids=batch.position_ids[token_index],
        cu_seqlens=cu,
        loss_mask=batch.loss_mask[token_index],
        extras=extras,
        prefixes=torch.tensor(prefixes, dtype=torch.long),
        unshared_index=unshared,
    )


def unshare_outputs(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Per-token ``values`` ([T_shared, ...]) of a shared ``batch`` -> [T_original, ...] (identity without sharing)."""
    if batch.unshared_index is None:
        return values
    return values[batch.unshared_index.to(values.device)]
