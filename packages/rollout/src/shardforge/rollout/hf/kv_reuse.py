"""KV reuse across turns for the embedded HF engine: each session's (episode's) KV cache, kept between calls.

A multi-turn episode's next prompt is its previous prompt + the generated tokens + the appended
user / tool tokens. Without reuse every turn re-encodes the whole conversation. With it, the engine
keeps the keys and values of ``prompt + response[:-1]`` (the last generated token was never fed)
per session, and the next call prefills only the new suffix on top of them.

One batched ``generate`` still serves every row (the sampled tokens depend on the batch's random
draws, so hits and misses must not be split into separate calls). Layout of a batch with cached
lengths ``c_b`` and new suffixes ``s_b`` (``C = max c_b``, ``S = max s_b``)::

    row b:  [pad x (C - c_b)] [cached c_b] | [pad x (S - s_b)] [suffix s_b]
            '-------- past_key_values --------' '------- input ids fed --------'

The attention mask is 0 on both pads; HF derives positions from its cumulative sum, so every token
keeps its true position (RoPE keys were rotated when they were cached). A row without a hit has
``c_b = 0``: its whole prompt is the suffix. Results equal the no-reuse path up to floating-point
reduction order (the same tolerance as a different padding width); `test_alg_kv_reuse.py` checks it.

Safety: a session's KV is only valid for the weights that computed it. Every call first compares a
fingerprint of the weights (the receiver's version and each parameter's storage and in-place
version counter) and drops every session on a change; a prompt that does not extend the cached ids
drops the session; `end_sessions` drops it when the episode ends; at most ``max_tokens`` tokens are
held (the oldest sessions are evicted first).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "KVReuseCache",
    "KVSession",
    "batch_layout",
    "cache_supports_reuse",
    "past_from_sessions",
    "session_from_cache",
    "weights_key",
]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVSession:
    """The cached keys/values of one session: ``ids`` = the tokens whose KV is held."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Per decoder layer (keys, values), each ``[kv_heads, len(ids), head_dim]``."""


class KVReuseCache:
    """Sessions' KV caches, oldest first, at most ``max_tokens`` tokens in all.

    Args:
        max_tokens: cap on the cached tokens over all sessions (each costs
            ``2 * layers * kv_heads * head_dim * dtype bytes``); the oldest sessions go first.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"kv_reuse_max_tokens={max_tokens} must be >= 1 (cached tokens over all sessions)")
        self.max_tokens = max_tokens
        self._sessions: OrderedDict[Hashable, KVSession] = OrderedDict()
        self._weights: object = None
        self.tokens = 0
        """Tokens cached now."""
        self.stats = dict.fromkeys(("hits", "misses", "reused_tokens", "evicted", "invalidated"), 0)
        """Counters since creation: rows served from a session (hits) or not (misses), tokens not re-encoded,
        sessions evicted by the cap, sessions dropped on a weight change."""

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: Hashable) -> bool:
        return session in self._sessions

    def check_weights(self, key: object) -> None:
        """Drop every session when the weights' fingerprint ``key`` differs from the one they were computed under."""
        if key != self._weights:
            self.invalidate()
            self._weights = key

    def invalidate(self) -> None:
        """Drop every session, counted as invalidated (the weights they were computed under are gone)."""
        self.stats["invalidated"] += len(self._sessions)
        self.clear()

    def clear(self) -> None:
        self._sessions.clear()
        self.tokens = 0

    def take(self, session: Hashable, prompt: Sequence[int]) -> KVSession | None:
        """Remove ``session`` and return it if ``prompt`` strictly extends its cached ids (else None: dropped)."""
        entry = self._sessions.pop(session, None)
        if entry is not None:
            self.tokens -= len(entry.ids)
        n = len(entry.ids) if entry is not None else 0
        if entry is None or len(prompt) <= n or list(prompt[:n]) != entry.ids:
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += n
        return entry

    def put(self, session: Hashable, entry: KVSession) -> None:
        """Keep ``entry`` as the newest session; evict the oldest ones past ``max_tokens``."""
        old = self._sessions.pop(session, None)
        self.tokens -= len(old.ids) if old is not None else 0
        if len(entry.ids) > self.max_tokens:  # alone past the cap: keep the others rather than evict them all
            self.stats["evicted"] += 1
            return
        self.tokens += len(entry.ids)
        self._sessions[session] = entry
        while self.tokens > self.max_tokens:
            _, evicted = self._sessions.popitem(last=False)
            self.tokens -= len(evicted.ids)
            self.stats["evicted"] += 1

    def end(self, sessions: Iterable[Hashable]) -> None:
        """Forget ``sessions`` (their episodes ended)."""
        for session in sessions:
            entry = self._sessions.pop(session, None)
            if entry is not None:
                self.tokens -= len(entry.ids)


def weights_key(version: int, model: torch.nn.Module) -> tuple[Any, ...]:
    """A fingerprint that changes whenever the weights may have: the receiver's version, and per parameter
    its storage (``.data = t`` swaps) and in-place version counter (``copy_``, ``load_state_dict``)."""
    params = tuple((p.data_ptr(), p._version) for p in model.parameters())  # type: ignore[attr-defined]
    return (version, params)


def batch_layout(
    prompts: Sequence[Sequence[int]], cached: Sequence[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, attention_mask, C)`` of the layout in the module docstring; ``cached[b]`` tokens of row b
    come from its session (0: none). With no session at all it is plain left padding (``C = 0``)."""
    width_cached = max(cached)
    width_new = max(len(p) - c for p, c in zip(prompts, cached, strict=True))
    ids_rows, mask_rows = [], []
    for ids, c in zip(prompts, cached, strict=True):
        # The cached ids go into input_ids too: HF slices the fed columns off the end, never reads these.
        new = len(ids) - c
        ids_rows.append([pad_id] * (width_cached - c) + list(ids[:c]) + [pad_id] * (width_new - new) + list(ids[c:]))
        mask_rows.append([0] * (width_cached - c) + [1] * c + [0] * (width_new - new) + [1] * new)
    return torch.tensor(ids_rows, dtype=torch.long), torch.tensor(mask_rows, dtype=torch.long), width_cached


def past_from_sessions(entries: Sequence[KVSession | None], width_cached: int) -> Any:
    """A batched ``DynamicCache`` of ``width_cached`` columns: each session right-aligned, zeros (masked) elsewhere."""
    from transformers import DynamicCache

    first = next(e for e in entries if e is not None)
    data = []
    for layer, (keys0, values0) in enumerate(first.layers):
        heads, _, dim = keys0.shape
        keys = keys0.new_zeros((len(entries), heads, width_cached, dim))
        values = values0.new_zeros((len(entries), heads, width_cached, dim))
        for row, entry in enumerate(entries):
            if entry is not None:
                k, v = entry.layers[layer]
                keys[row, :, width_cached - k.shape[1] :] = k
                values[row, :, width_cached - v.shape[1] :] = v
        data.append((keys, values))
    return DynamicCache(ddp_cache_data=data)


def cache_supports_reuse(cache: Any) -> bool:
    """True for a ``DynamicCache`` of plain full-attention layers (sliding-window and linear-attention layers
    keep truncated or recurrent state that cannot be cut per row)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


def session_from_cache(cache: Any, row: int, spans: Sequence[tuple[int, int]], ids: list[int]) -> KVSession:
    """Row ``row``'s keys/values at the column ``spans`` (``[start, end)``, in order) of a batched cache, copied."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[row, :, start:end] for start, end in spans], dim=1)

    layers = [(cut(layer.keys), cut(layer.values)) for layer in cache.layers]
    assert layers[0][0].shape[1] == len(ids)
    return KVSession(ids=ids, layers=layers)
