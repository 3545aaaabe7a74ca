"""Which decoder layers each pipeline stage owns, and which stages each pp rank runs.

A *stage* is a contiguous run of decoder layers; stage 0 also owns the token embedding,
the last stage the final norm and lm_head. With ``v`` virtual stages per rank there are
``pp * v`` stages: looped schedules (Interleaved1F1B) give rank r the stages
``r, r + pp, r + 2 pp, ...``; V-shaped schedules (ZB-V) give it ``r`` and ``2 pp - 1 - r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

__all__ = ["balanced_layers_per_stage", "split_layers", "stage_ids_for_rank"]

StageStyle = Literal["loop", "v"]


def balanced_layers_per_stage(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts that differ by at most one; the extra layers go to the earliest stages
    (the last stage also runs lm_head and the loss, usually the most expensive part)."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} decoder layers into {num_stages} stages (every stage needs at least one "
            f"layer); use at most {num_layers} stages in total (pp x virtual stages per rank), e.g. "
            f"{_stage_count_examples(num_layers)}"
        )
    base, extra = divmod(num_layers, num_stages)
    return [base + 1 if i < extra else base for i in range(num_stages)]


def split_layers(
    num_layers: int,
    num_stages: int,
    layers_per_stage: int | Sequence[int] | None = None,
) -> list[range]:
    """The global layer indices of every stage, in stage order.

    Args:
        num_layers: decoder layers of the model (``config.num_hidden_layers``).
        num_stages: stages in total (pp x virtual stages per rank).
        layers_per_stage: None = balanced split; an int = that many layers in every stage
            (must divide ``num_layers`` exactly); a list = the layer count of each stage.

    Raises:
        ValueError: when the layers cannot be split as asked; the message proposes valid layouts.
    """
    balanced = balanced_layers_per_stage(num_layers, num_stages)
    if layers_per_stage is None:
        counts = balanced
    elif isinstance(layers_per_stage, int):
        if layers_per_stage < 1 or layers_per_stage * num_stages != num_layers:
            raise ValueError(
                f"layers_per_stage={layers_per_stage} x {num_stages} stages != {num_layers} layers; "
                f"{_suggestions(num_layers, num_stages, balanced)}"
            )
        counts = [layers_per_stage] * num_stages
    else:
        counts = [int(c) for c in layers_per_stage]
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"layers_per_stage={counts} must list {num_stages} counts >= 1 that sum to {num_layers} "
                f"(got {len(counts)} counts summing to {sum(counts)}); {_suggestions(num_layers, num_stages, balanced)}"
            )
    out: list[range] = []
    start = 0
    for count in counts:
        out.append(range(start, start + count))
        start += count
    return out


def stage_ids_for_rank(pp_rank: int, pp_size: int, stages_per_rank: int, style: StageStyle = "loop") -> list[int]:
    """The global stage indices that ``pp_rank`` runs, in increasing order."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, {pp_size})")
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
    if style == "loop":
        return [pp_rank + k * pp_size for k in range(stages_per_rank)]
    if style == "v":
        if stages_per_rank != 2:
            raise ValueError(f"V-shaped schedules need exactly 2 stages per rank, got {stages_per_rank}")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    raise ValueError(f"unknown stage style {style!r}; valid: 'loop', 'v'")


def _suggestions(num_layers: int, num_stages: int, balanced: list[int]) -> str:
    even = [s for s in range(1, num_layers + 1) if num_layers % s == 0]
    hint = f"valid: layers_per_stage=None (balanced: {balanced}) or any list of {num_stages} counts >= 1 summing to "
    hint += f"{num_layers}"
    if num_layers % num_stages == 0:
        hint += f", or layers_per_stage={num_layers // num_stages}"
    else:
        hint += f"; an equal split of {num_layers} layers needs a stage count in {even}"
    return hint


def _stage_count_examples(num_layers: int) -> str:
    return ", ".join(f"{s} stages x {num_layers // s} layers" for s in range(1, num_layers + 1) if num_layers % s == 0)
