"""Router replay (R3): record the experts each token was routed to, and route a later forward the same way.

In RL the rollout engine and the trainer compute the same MoE model with different kernels, batch
shapes or precision, and a token whose top-k scores are close can go to different experts in the
two: its log-prob then comes from a different sub-network, which inflates the trainer/engine
mismatch far beyond what dense models show. Rollout Routing Replay ("R3", Ma et al. 2025,
"Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers") records the
rollout's top-k expert indices per token and layer and makes the trainer use them: the trainer's
own router still computes its probabilities, and the gate weights are its probabilities of the
*recorded* experts (renormalised as the family does), so router gradients still flow.

`RouterReplay` hooks each MoE block's router (forward hooks; no patching). Inside
``with replay.record()`` every router call appends its ``[rows, K]`` top-k indices; inside
``with replay.replay(indices)`` (``[T, L, K]``, layer order = module order) each router's output is
replaced by ``(logits, its probabilities of the recorded experts, the recorded experts)`` for rows
whose recorded indices are all >= 0; rows past ``T`` (padding) or marked -1 keep the router's own
choice. Expert parallelism is unaffected: it dispatches whatever indices the router returns.
Activation checkpointing recomputes under the same replay as long as backward runs inside the block.

Legend: T tokens, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardforge.moe_ep.families import family_of, find_moe_blocks

__all__ = ["RouterReplay"]


class RouterReplay:
    """Records or replays every MoE router's top-k expert choice of ``model`` (see the module)."""

    def __init__(self, model: nn.Module) -> None:
        family = family_of(model)
        routers = [getattr(block, family.router_attr) for _, block in find_moe_blocks(model)]
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE blocks to replay")
        self.num_layers = len(routers)
        self.top_k = int(routers[0].top_k)
        self._layer = {id(r): i for i, r in enumerate(routers)}
        self._normalize = {id(r): bool(getattr(r, "norm_topk_prob", True)) for r in routers}
        self._recorded: list[list[torch.Tensor]] | None = None
        self._replay: torch.Tensor | None = None
        self._counts: list[torch.Tensor] = []  # [mismatched, replayed] per router call (no device sync per call)
        self._handles: list[RemovableHandle] = [r.register_forward_hook(self._hook) for r in routers]

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()

    @contextmanager
    def record(self) -> Iterator[list[list[torch.Tensor]]]:
        """Yield per-layer lists that fill with each router call's ``[rows, K]`` int64 top-k indices (CPU)."""
        self._recorded = [[] for _ in range(self.num_layers)]
        try:
            yield self._recorded
        finally:
            self._recorded = None

    @contextmanager
    def replay(self, indices: torch.Tensor) -> Iterator[None]:
        """Route by ``indices`` ``[T, L, K]`` (int; -1 = keep the router's own choice for that row)."""
        if indices.dim() != 3 or indices.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"replay indices must be [T, {self.num_layers} layers, top_k {self.top_k}], got {tuple(indices.shape)}"
            )
        self._replay = indices
        try:
            yield
        finally:
            self._replay = None

    def pop_mismatch(self) -> tuple[int, int]:
        """(rows whose own top-k expert set differed from the recorded one, rows replayed), summed over
        layers and router calls since the last call; then reset."""
        if not self._counts:
            return 0, 0
        total = torch.stack(self._counts).sum(dim=0).tolist()
        self._counts = []
        return int(total[0]), int(total[1])

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        logits, scores, chosen = output
        if self._replay is None:
            self._store(module, chosen)
            return None
        rows = chosen.shape[0]
        wanted = torch.full_like(chosen, -1)
        count = min(rows, self._replay.shape[0])
        wanted[:count] = self._replay[:count, self._layer[id(module)]].to(chosen.device, chosen.dtype)
        use = (wanted >= 0).all(dim=-1)  # [rows]
        experts = torch.where(use[:, None], wanted, chosen)
        probs = torch.softmax(logits.float(), dim=-1)
        gates = probs.gather(-1, experts)
        if self._normalize[id(module)]:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        gates = torch.where(use[:, None], gates.to(scores.dtype), scores)
        with torch.no_grad():
            differs = (torch.sort(chosen, dim=-1).values != torch.sort(experts, dim=-1).values).any(dim=-1)
            self._counts.append(torch.stack([(use & differs).sum(), use.sum()]))
        self._store(module, experts)  # what the block will use
        return logits, gates, experts

    def _store(self, module: nn.Module, experts: torch.Tensor) -> None:
        if self._recorded is not None:
            self._recorded[self._layer[id(module)]].append(experts.detach().to("cpu", torch.int64))
