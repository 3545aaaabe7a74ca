"""Shared prompt prefixes in the engine (``EngineConfig.share_prefixes``; `batching.prefix_sharing`).

Every micro-batch is shared after the token-budget split (sharing only removes tokens, so the budget
and the micro-batch count every rank agreed on still hold); outputs go back to the caller's token
layout with `unshare_outputs`. Where it runs: the packed attention's per-sequence SDPA path holds the
shared keys, so it needs a dense decoder (no MoE: the load-balancing loss counts tokens), a text head,
no context or pipeline parallelism and no sliding-window attention. ``None`` (auto) turns it on there
except on CUDA, where fp16/bf16 attention runs the flash varlen kernel, which takes no prefixes
(untimed on GPUs: set ``true`` to measure it).
"""

from __future__ import annotations

from typing import Any

from shardforge.engine.context import ParallelContext

__all__ = ["prefix_sharing_blockers", "use_prefix_sharing"]


def prefix_sharing_blockers(ctx: ParallelContext, head: Any, hf_config: Any, moe: bool) -> list[str]:
    """Why this engine cannot share prefixes (empty: it can)."""
    blockers = []
    if not getattr(head, "supports_prefix_sharing", False):
        blockers.append(f"the {type(head).__name__} head (image inputs are not shared)")
    if moe:
        blockers.append("an MoE model (its load-balancing loss counts every token)")
    if ctx.dims.cp > 1:
        blockers.append(f"context parallelism (cp={ctx.dims.cp})")
    if ctx.dims.pp > 1:
        blockers.append(f"pipeline parallelism (pp={ctx.dims.pp})")
    layer_types = getattr(hf_config, "layer_types", None) or ()
    sliding = any("sliding" in str(t) for t in layer_types) or (
        getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True)
    )
    if sliding:
        blockers.append("sliding-window attention")
    return blockers


def use_prefix_sharing(ctx: ParallelContext, head: Any, hf_config: Any, moe: bool) -> bool:
    """Whether micro-batches share prefixes: ``ctx.config.share_prefixes`` (None = auto, see the module)."""
    wanted = ctx.config.share_prefixes
    if wanted is False:
        return False
    blockers = prefix_sharing_blockers(ctx, head, hf_config, moe)
    if wanted is True and blockers:
        raise ValueError(
            f"engine.share_prefixes=true is not supported with {', '.join(blockers)}; "
            "set engine.share_prefixes=false (or leave it unset: auto turns it on where it is supported)"
        )
    return not blockers and (wanted is True or ctx.device.type != "cuda")
