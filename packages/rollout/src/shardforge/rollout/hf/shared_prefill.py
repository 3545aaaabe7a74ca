"""Prefill each distinct prompt once for a batch of samples that share prompts (GRPO groups).

A ``generate`` call of ``P`` prompts x ``n`` samples has ``B = P * n`` left-padded rows of width ``W`` whose
prompt columns come in ``n`` identical copies. HF ``generate`` encodes every row (``B * W`` prompt
tokens); here the ``P`` distinct rows are encoded once over the first ``W - 1`` columns, their keys and
values are copied to the ``n`` rows of each, and ``generate`` continues from that cache (it feeds only the
last prompt column, as with a reused session in `rollout.kv_reuse`). At ``n = 8`` that is 8x fewer prefill
tokens; the logits are those of re-encoding up to float reduction order (different matmul shapes), so the
sampled tokens follow the same distribution and the per-row seeds (`rollout.row_sampler`) still decide them.
TRL, like plain ``generate``, encodes each of the ``n`` copies.

Only for caches that can be indexed per row (``DynamicCache`` of full-attention layers, as
`kv_reuse.cache_supports_reuse`), text models (a VLM's mRoPE positions come from the whole prompt), and no
router recording (which needs every row's routing).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

__all__ = ["shared_prefill"]


@torch.no_grad()
def shared_prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, keys: Sequence[Hashable]
) -> Any:
    """A ``DynamicCache`` of the first ``W - 1`` columns of every row, computed once per distinct ``keys[b]``
    (rows with equal keys must have equal ``input_ids``/``attention`` rows); None when no prompt repeats, the
    prompts are one column wide, or the model's cache cannot be copied per row (then ``generate`` encodes all).

    ``input_ids``/``attention``: ``[B, W]`` left-padded (`kv_reuse.batch_layout` with no session), on the
    model's device."""
    from shardforge.rollout.hf.kv_reuse import cache_supports_reuse

    first: dict[Hashable, int] = {}
    for row, key in enumerate(keys):
        first.setdefault(key, row)
    width = input_ids.shape[1]
    kinds = getattr(getattr(model, "config", None), "layer_types", None) or ("full_attention",)
    if len(first) == len(keys) or width < 2 or any(kind != "full_attention" for kind in kinds):
        return None  # (sliding-window / linear-attention layers: checked again on the cache below)
    distinct = torch.tensor(list(first.values()), device=input_ids.device)
    ids, mask = input_ids[distinct, : width - 1], attention[distinct, : width - 1]
    # The positions `generate` gives left-padded rows (prepare_inputs_for_generation): 0 at the first real token.
    positions = (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 1)
    cache = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True).past_key_values
    if not cache_supports_reuse(cache):
        return None
    slot = {key: i for i, key in enumerate(first)}
    expand = torch.tensor([slot[key] for key in keys], device=input_ids.device)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(0, expand), layer.values.index_select(0, expand)
    return cache
