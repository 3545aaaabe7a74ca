"""Per-request sampling seeds: every response draws from its own stream, whichever call, batch or rank runs it.

A trainer names each request by what it is (run seed, step, round, the prompt's position in the step's
global batch, sample, turn), never by where it runs (data-parallel rank, batch row, ``batch_size`` chunk),
and the engines sample request ``(prompt i, sample j)`` from seed ``seeds[i] + j`` (vLLM's convention for
``n`` samples of one seeded request). So world 1 and FSDP 2 sample the same responses from the same
weights, and a resumed or asynchronous run samples what the uninterrupted one did.
"""

from __future__ import annotations

from shardforge.rollout.types import SamplingParams

__all__ = ["SEED_LIMIT", "prompt_seeds", "request_seed"]

SEED_LIMIT = 2**62
"""Every derived seed (plus its sample index) stays below this (vLLM and torch take 63-bit seeds)."""

_MASK = 2**64 - 1


def request_seed(seed: int, index: int, room: int = 1) -> int:
    """A well-mixed seed in ``[0, 2**62 - room)`` for item ``index`` of ``seed`` (splitmix64's finaliser), so
    neighbouring seeds and indices give unrelated streams; ``room``: ``result + k`` for ``k < room`` (the sample
    index) stays in range."""
    if room < 1:
        raise ValueError(f"room={room} must be >= 1 (the samples that share a request seed)")
    value = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _MASK
    value ^= value >> 31
    value = (value * 0x94D049BB133111EB) & _MASK
    value ^= value >> 29
    return (value >> 2) % (SEED_LIMIT - room)


def prompt_seeds(params: SamplingParams, num_prompts: int) -> list[int] | None:
    """The seed of sample 0 of each prompt of a ``generate`` call (sample ``j``: ``+ j``): ``params.seeds`` as
    given, else derived from ``params.seed`` and the prompt's position in the call; None when unseeded."""
    if params.seeds is not None:
        if len(params.seeds) != num_prompts:
            raise ValueError(f"SamplingParams.seeds has {len(params.seeds)} seeds for {num_prompts} prompts")
        return list(params.seeds)
    if params.seed is None:
        return None
    return [request_seed(params.seed, i, params.n) for i in range(num_prompts)]
