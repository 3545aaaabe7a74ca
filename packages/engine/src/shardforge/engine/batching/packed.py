"""Packed batches: all sequences concatenated into one row, no padding.

Legend: T = total tokens, N = sequences. ``cu_seqlens`` [N+1] marks sequence starts.
``loss_mask[t] = 1`` means token t is a training *target* (it is predicted from the tokens
before it in its sequence); the first token of a sequence can never be a target.
Per-token tensors in ``extras`` (rewards, old log-probs, advantages, ...) follow the same
target alignment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["PackedBatch", "cu_seqlens_of", "pack_sequences", "pad_to_multiple"]


def cu_seqlens_of(lengths: Sequence[int]) -> torch.Tensor:
    """[N+1] int32 cumulative sequence lengths (0, len0, len0+len1, ...)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int32), 0)
    return cu


@dataclass(kw_only=True)
class PackedBatch:
    """A packed batch of N sequences, T tokens in total."""

    input_ids: torch.Tensor
    """[T] int64 token ids."""
    position_ids: torch.Tensor
    """[T] int64 positions, restarting at 0 for every sequence."""
    cu_seqlens: torch.Tensor
    """[N+1] int32 cumulative sequence lengths (0, len0, len0+len1, ...)."""
    loss_mask: torch.Tensor
    """[T] float32 1.0 where the token is a training target."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Optional per-token [T] or per-sequence [N] tensors (rewards, advantages, ...)."""
    prefixes: torch.Tensor | None = None
    """[N, 2] int64 shared prefixes (`batching.prefix_sharing`): sequence i attends to tokens
    [start, start + length) of this batch before its own; length 0 = none. None = no sharing."""
    unshared_index: torch.Tensor | None = None
    """With ``prefixes``: [T_full] int64, for every token of the batch before sharing, the token of this
    batch that has its outputs (`batching.prefix_sharing.unshare_outputs`)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()  # type: ignore[no-any-return]

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            loss_mask=self.loss_mask.to(device),
            extras={k: v.to(device) for k, v in self.extras.items()},
            prefixes=self.prefixes,
            unshared_index=self.unshared_index,
        )

    def select(self, indices: Sequence[int]) -> PackedBatch:
        """A new packed batch with the sequences at ``indices`` (in that order)."""
        if self.prefixes is not None:
            raise ValueError("select() on a batch with shared prefixes: select before `share_prefixes`")
        bounds = self.cu_seqlens.tolist()
        spans = [(bounds[i], bounds[i + 1]) for i in indices]
        token_index = torch.cat([torch.arange(a, b) for a, b in spans]) if spans else torch.zeros(0, dtype=torch.long)
        cu = cu_seqlens_of([b - a for a, b in spans])
        extras: dict[str, torch.Tensor] = {}
        for key, value in self.extras.items():
            if value.shape[0] == self.num_tokens:
                extras[key] = value[token_index]
            elif value.shape[0] == self.num_sequences:
                extras[key] = value[list(indices)]
            else:
                raise ValueError(
                    f"extra {key!r} has leading size {value.shape[0]}; expected T={self.num_tokens} "
                    f"(per token) or N={self.num_sequences} (per sequence)"
                )
        return PackedBatch(
            input_ids=self.input_ids[token_index],
            position_ids=self.position_ids[token_index],
            cu_seqlens=cu,
            loss_mask=self.loss_mask[token_index],
            extras=extras,
        )


def pack_sequences(
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[float]] | None = None,
) -> PackedBatch:
    """Concatenate token lists into a `PackedBatch`. ``loss_masks`` default to all targets."""
    if len(sequences) == 0:
        raise ValueError("cannot pack an empty list of sequences")
    if loss_masks is not None and len(loss_masks) != len(sequences):
        raise ValueError(f"got {len(sequences)} sequences but {len(loss_masks)} loss masks")
    ids, pos, masks, lengths = [], [], [], []
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty; drop empty sequences before packing")
        ids.append(torch.as_tensor(list(seq), dtype=torch.long))
        pos.append(torch.arange(len(seq), dtype=torch.long))
        if loss_masks is None:
            mask = torch.ones(len(seq), dtype=torch.float32)
        else:
            mask = torch.as_tensor(list(loss_masks[i]), dtype=torch.float32)
            if mask.numel() != len(seq):
                raise ValueError(f"sequence {i} has {len(seq)} tokens but its loss mask has {mask.numel()}")
        mask = mask.clone()
        mask[0] = 0.0  # the first token has no context to be predicted from
        masks.append(mask)
        lengths.append(len(seq))
    return PackedBatch(
        input_ids=torch.cat(ids),
        position_ids=torch.cat(pos),
        cu_seqlens=cu_seqlens_of(lengths),
        loss_mask=torch.cat(masks),
    )


def pad_to_multiple(batch: PackedBatch, multiple: int) -> PackedBatch:
    """Append one padding sequence (token 0, zero loss mask) so T is a multiple of ``multiple``.

    The padding is its own sequence in ``cu_seqlens``, so packed attention never mixes it
    with real tokens; callers trim per-token outputs back to the original T.
    """
    pad = (-batch.num_tokens) % multiple
    if pad == 0:
        return batch
    extras = {}
    for key, value in batch.extras.items():
        if value.shape[0] == batch.num_tokens:
            value = torch.cat([value, value.new_zeros((pad, *value.shape[1:]))])
        elif value.shape[0] == batch.num_sequences:
            value = torch.cat([value, value.new_zeros((1, *value.shape[1:]))])
        extras[key] = value
    return PackedBatch(
        input_ids=torch.cat([batch.input_ids, batch.input_ids.new_zeros(pad)]),
        position_ids=torch.cat([batch.position_ids, torch.arange(pad, dtype=batch.position_ids.dtype)]),
        cu_seqlens=torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + pad]),
        loss_mask=torch.cat([batch.loss_mask, batch.loss_mask.new_zeros(pad)]),
        extras=extras,
        prefixes=None if batch.prefixes is None else torch.cat([batch.prefixes, batch.prefixes.new_zeros(1, 2)]),
        unshared_index=batch.unshared_index,
    )
