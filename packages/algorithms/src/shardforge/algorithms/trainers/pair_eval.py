"""ONE held-out evaluation for the pair trainers (reward model, DPO): the held-out pairs in chunks of
``eval_batch_size``, each chunk split over the data-parallel ranks, the loss weighted globally."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardforge.engine.batching import PackedBatch

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    from shardforge.engine import TrainEngine

__all__ = ["pair_eval_loss"]


def pair_eval_loss(
    engine: TrainEngine,
    num_pairs: int,
    batch_size: int,
    loss_fn: Any,
    pack: Callable[[list[int], float], PackedBatch],
) -> float:
    """The global loss of ``loss_fn`` (with its ``loss_weight``) over pairs ``0 .. num_pairs - 1``; ``pack(indices,
    weight)`` packs this rank's pairs of a chunk. The loss function keeps its statistics (the caller pops and
    reduces them). Collective over ``engine``'s ranks."""
    loss_sum = weight_sum = 0.0
    for begin in range(0, num_pairs, batch_size):
        chunk = list(range(begin, min(begin + batch_size, num_pairs)))
        mine = chunk[engine.dp_rank :: engine.dp_size]
        # A rank without a share still runs (collectives must match) on a zero-weight pair.
        batch = pack(mine or chunk[:1], 1.0 if mine else 0.0)
        stats = engine.eval_batch(batch, loss_fn, loss_fn.loss_weight)
        loss_sum += stats["loss"] * stats["loss_weight"]
        weight_sum += stats["loss_weight"]
    return loss_sum / max(weight_sum, 1e-12)
