"""Interruptible generation for partial rollouts: any engine, one chunk of new tokens at a time.

`generate_in_chunks` runs a generation ``chunk_tokens`` new tokens at a time. After each chunk
``between_chunks`` may load newer weights (the asynchronous generator's refresh); unfinished rows then
continue from their prompt + generated ids under whatever weights the engine serves, and rows that
finished leave the batch. Every token keeps the weight version and behaviour log-prob of the chunk
that produced it (`Rollout.token_versions`), which the decoupled loss and rollout correction use token
by token. ``between_chunks`` may also answer True: stop here (the streaming source's groups that no batch can
take any more), and the unfinished rows end as they are (``finished=False``, like a length cut). The embedded HF
engine and both vLLM engines (in-process: the engine's weights are swapped
between two ``generate`` calls; server: each chunk is a completion request that a weight update can
follow) share this loop; each supplies how to generate one chunk for the rows still active.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from shardforge.rollout.seeds import prompt_seeds, request_seed
from shardforge.rollout.types import Rollout, SamplingParams

__all__ = ["ChunkFn", "ChunkedGeneration", "chunked_requests", "generate_in_chunks"]


class ChunkedGeneration:
    """Partial rollouts' side of an engine: built with one, an engine generates ``chunk_tokens`` new tokens at a
    time and calls `between_chunks` after each chunk. What happens there belongs to whoever drives the generation
    (the asynchronous batch source switches to newer weights): it says so for the length of a batch with
    `refreshing`, and may stop the generation there (see `between_chunks`). The same object is handed to the engine's constructor and to the batch source, so nothing sets
    an attribute of the engine from outside.

    Args:
        chunk_tokens: new tokens generated between two calls of `between_chunks` (>= 1).
    """

    def __init__(self, chunk_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ValueError(
                f"rollout.interrupt_chunk_tokens={chunk_tokens} must be >= 1 (tokens generated between two checks for newer "
                "weights)"
            )
        self.chunk_tokens = chunk_tokens
        self._lock = threading.Lock()
        self._refresh: Callable[[], bool | None] | None = None

    @contextmanager
    def refreshing(self, fn: Callable[[], bool | None]) -> Iterator[None]:
        """While active, `between_chunks` calls ``fn`` (e.g. load the newest weights this batch may use); ``fn``
        returns True to stop the generation at this chunk boundary."""
        with self._lock:
            self._refresh = fn
        try:
            yield
        finally:
            with self._lock:
                self._refresh = None

    @property
    def is_refreshing(self) -> bool:
        """Whether a `refreshing` block is active (something runs between chunks)."""
        with self._lock:
            return self._refresh is not None

    def between_chunks(self) -> bool:
        """Called by the engine after each chunk that left unfinished rows; True: stop generating (the unfinished
        rows end as they are)."""
        with self._lock:
            fn = self._refresh
        return bool(fn()) if fn is not None else False


ChunkFn = Callable[[list[int], list[tuple[int, list[int]]], int, int], list[Rollout]]
"""(active row indices, their (prompt index, prompt + generated ids), the chunk's token budget, tokens already
generated per active row) -> one `Rollout` per active row: the chunk's new tokens, their log-probs, ``finished``
(stopped on EOS) and the serving ``version``."""


def generate_in_chunks(
    rows: list[tuple[int, list[int]]],
    max_new_tokens: int,
    chunk_tokens: int,
    chunk: ChunkFn,
    between_chunks: Callable[[], bool | None] | None,
    decode: Callable[[list[int]], str],
) -> list[Rollout]:
    """``rows``: (prompt index, prompt ids), one per response. Returns one `Rollout` per row, in order.
    ``between_chunks`` answering True stops the generation: the unfinished rows keep what they have."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    ids: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[float]] = [[] for _ in rows]
    versions: list[list[int]] = [[] for _ in rows]
    finished = [False] * len(rows)
    active, remaining = list(range(len(rows))), max_new_tokens
    while active and remaining > 0:
        budget = min(chunk_tokens, remaining)
        done = max_new_tokens - remaining  # unfinished rows generated every token so far
        parts = chunk(active, [(rows[i][0], rows[i][1] + ids[i]) for i in active], budget, done)
        if len(parts) != len(active):
            raise RuntimeError(f"a chunk returned {len(parts)} rollouts for {len(active)} active rows")
        for i, part in zip(active, parts, strict=True):
            ids[i] += part.response_ids
            logprobs[i] += part.logprobs
            versions[i] += [part.version] * len(part.response_ids)
            finished[i] = part.finished
        active, remaining = [i for i in active if not finished[i]], remaining - budget
        if active and remaining > 0 and between_chunks is not None and between_chunks():
            break
    return [
        Rollout(
            prompt_index=prompt_index,
            prompt_ids=prompt,
            response_ids=ids[i],
            logprobs=logprobs[i],
            finished=finished[i],
            version=min(versions[i]) if versions[i] else 0,
            text=decode(ids[i]),
            token_versions=versions[i],
        )
        for i, (prompt_index, prompt) in enumerate(rows)
    ]


def chunked_requests(
    generate: Callable[[list[list[int]], SamplingParams], list[Rollout]],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    chunk_tokens: int,
    between_chunks: Callable[[], bool | None] | None,
    decode: Callable[[list[int]], str],
) -> list[Rollout]:
    """`generate_in_chunks` for an engine that takes whole requests with per-prompt seeds (vLLM, in-process or
    server): every response is a request of its own (n=1) for each chunk. The first chunk samples from the
    response's seed (``seeds[i] + j``, as one uninterrupted request would); a continuation after ``done``
    tokens samples from ``request_seed(that seed, done)``, since a re-sent request restarts its sampler."""
    seeds = prompt_seeds(params, len(prompts))
    rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
    row_seeds = None if seeds is None else [seeds[i] + j for i in range(len(prompts)) for j in range(params.n)]

    def chunk(active: list[int], context: list[tuple[int, list[int]]], budget: int, done: int) -> list[Rollout]:
        chunk_seeds = None
        if row_seeds is not None:
            chunk_seeds = tuple(row_seeds[i] if done == 0 else request_seed(row_seeds[i], done) for i in active)
        one = dataclasses.replace(params, n=1, max_new_tokens=budget, seed=None, seeds=chunk_seeds)
        return generate([ids for _, ids in context], one)

    return generate_in_chunks(rows, params.max_new_tokens, chunk_tokens, chunk, between_chunks, decode)
