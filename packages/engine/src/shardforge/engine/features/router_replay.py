"""Router replay (R3) in the engine: MoE forwards route each token as the rollout engine did.

With ``EngineConfig.router_replay`` on an MoE model, every micro-batch that carries
``extras[ROUTED_EXPERTS]`` (``[T, L, K]`` expert indices per token and MoE layer, recorded by the
rollout engine; -1 where none was recorded) runs its forward *and* backward inside
`shardforge.moe_ep.RouterReplay.replay` (backward too: activation checkpointing recomputes the
forward there). Each step reports ``router_replay/mismatch_frac``: the share of (token, layer)
routings the trainer's own router would have chosen differently, global over the data-parallel
ranks. Supported on layouts where each MoE block sees its micro-batch's whole (padded) token
sequence: not with context parallelism or pipeline parallelism (refused in `engine.checks`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.engine.batching import PackedBatch
from shardforge.moe_ep import RouterReplay

__all__ = ["ROUTED_EXPERTS", "build_router_replay", "replay_stats", "replaying"]

ROUTED_EXPERTS = "routed_experts"
"""[T, L, K] int extra: the experts the rollout engine routed each token to, per MoE layer (-1: none)."""


def build_router_replay(model: nn.Module, enabled: bool) -> RouterReplay | None:
    """The model's `RouterReplay` when ``enabled`` (the checks have made sure the model is MoE)."""
    return RouterReplay(model) if enabled else None


def replaying(replay: RouterReplay | None, mb: PackedBatch) -> AbstractContextManager[Any]:
    """Route ``mb`` by its recorded experts (no-op without replay or without the extra)."""
    if replay is None or ROUTED_EXPERTS not in mb.extras:
        return nullcontext()
    return replay.replay(mb.extras[ROUTED_EXPERTS])


def replay_stats(
    replay: RouterReplay | None, group: dist.ProcessGroup | None, device: torch.device
) -> dict[str, float]:
    """``router_replay/mismatch_frac`` since the last call, summed over ``group`` (collective when given)."""
    if replay is None:
        return {}
    mismatched, rows = replay.pop_mismatch()
    counts = torch.tensor([float(mismatched), float(rows)], dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(counts, group=group)
    mismatched_total, rows_total = counts.tolist()
    return {"router_replay/mismatch_frac": mismatched_total / rows_total if rows_total else 0.0}
