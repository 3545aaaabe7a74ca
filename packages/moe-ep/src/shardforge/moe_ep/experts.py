"""`ParallelExperts`: a drop-in for an HF fused experts module, with token dispatch over ranks.

HF MoE blocks route tokens with their own router and then call
``self.experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``. This module
replaces ``block.experts`` (same parameter names ``gate_up_proj`` / ``down_proj``, so
checkpoint keys do not change) and computes the same function:

1. sort the T*K token copies by expert (one stable argsort);
2. with expert parallelism: exchange per-expert counts, then all-to-all the rows to the
   rank owning each expert (experts are split on dim 0 over the EP group, in order);
3. regroup the received rows by local expert and run one grouped matmul per projection;
4. all-to-all the results back, undo the sort, weight by the router scores and sum over K.

Legend: T tokens, K top-k, H hidden, E experts, El = E / ep local experts, P = ep,
N rows received by this rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.moe_ep.comm import (
    all_reduce_sum,
    all_to_all_rows,
    copy_to_group,
    exchange_counts,
    gather_rows,
    split_rows,
)
from shardforge.moe_ep.grouped import expert_mlp

__all__ = ["ParallelExperts"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ParallelExperts(nn.Module):
    """Fused experts with optional expert parallelism (EP) and expert tensor parallelism (ETP).

    Args:
        gate_up_proj: ``[E, 2I, H]`` parameter (gate rows first), taken over from the HF module.
        down_proj: ``[E, H, I]`` parameter.
        act_fn: the experts' activation (``act_fn`` of the HF module).
        num_experts: E, the global expert count.
        ep_group: the group experts are split over (dim 0), or None for no EP.
        etp_group: the group each expert's intermediate dim is split over, or None.
        token_group: with EP borrowing tensor-parallel ranks: the TP group whose ranks hold
            the same (replicated) tokens; each rank routes only its share of them.
    """

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        num_experts: int,
        ep_group: dist.ProcessGroup | None = None,
        etp_group: dist.ProcessGroup | None = None,
        token_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.etp_group = etp_group
        self.token_group = token_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if num_experts % self.ep_size != 0:
            raise ValueError(f"ep={self.ep_size} must divide num_experts={num_experts}")
        self.num_local_experts = num_experts // self.ep_size

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, ep={self.ep_size}, local_experts={self.num_local_experts}, "
            f"etp={dist.get_world_size(self.etp_group) if self.etp_group is not None else 1}, "
            f"token_split={dist.get_world_size(self.token_group) if self.token_group is not None else 1}"
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        x_TH, index_TK, weights_TK = hidden_states, top_k_index, top_k_weights
        if self.etp_group is not None:
            # Each ETP rank computes a partial output from the replicated inputs, so their
            # gradients are partial too: sum them in backward.
            x_TH, weights_TK = copy_to_group(x_TH, self.etp_group), copy_to_group(weights_TK, self.etp_group)
        if self.token_group is not None:
            x_TH, index_TK, weights_TK = self._split_tokens(x_TH, index_TK, weights_TK)
        out_TH = self._routed(x_TH, index_TK, weights_TK)
        if self.token_group is not None:
            out_TH = gather_rows(out_TH, self.token_group)[:num_tokens]
        if self.etp_group is not None:
            # Each ETP rank holds a slice of every expert's intermediate dim: partial sums.
            out_TH = all_reduce_sum(out_TH, self.etp_group)
        return out_TH.to(hidden_states.dtype)

    def _split_tokens(
        self, x_TH: torch.Tensor, index_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.token_group is not None
        size = dist.get_world_size(self.token_group)
        pad = -x_TH.shape[0] % size
        if pad:
            # Padding rows go to expert 0 with weight 0: they cost a little compute, add nothing.
            x_TH = torch.cat([x_TH, x_TH.new_zeros(pad, x_TH.shape[1])])
            index_TK = torch.cat([index_TK, index_TK.new_zeros(pad, index_TK.shape[1])])
            weights_TK = torch.cat([weights_TK, weights_TK.new_zeros(pad, weights_TK.shape[1])])
        index_TK = index_TK.chunk(size)[dist.get_rank(self.token_group)]
        return split_rows(x_TH, self.token_group), index_TK, split_rows(weights_TK, self.token_group)

    def _routed(self, x_TH: torch.Tensor, index_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = index_TK.shape
        flat_expert = index_TK.reshape(-1)
        # Stable sort keeps token order within an expert (deterministic, like the HF loop).
        order = torch.argsort(flat_expert, stable=True)
        rows_NH = x_TH.index_select(0, order // top_k)
        counts_E = torch.bincount(flat_expert, minlength=self.num_experts)
        gate_up = _local(self.gate_up_proj)
        down = _local(self.down_proj)
        if self.ep_group is None:
            out_rows = expert_mlp(rows_NH, gate_up, down, counts_E, self.act_fn)
        else:
            out_rows = self._dispatch_compute_combine(rows_NH, counts_E, gate_up, down)
        # Undo the sort: row j of the sorted order belongs to (token, k) = order[j].
        out_TKH = torch.empty_like(out_rows).index_copy(0, order, out_rows).view(num_tokens, top_k, out_rows.shape[-1])
        return (out_TKH * weights_TK.unsqueeze(-1)).sum(dim=1)

    def _dispatch_compute_combine(
        self, rows_NH: torch.Tensor, counts_E: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        assert self.ep_group is not None
        P, El = self.ep_size, self.num_local_experts
        send_PE = counts_E.view(P, El)
        # recv_PE[src, e]: rows rank ``src`` sends for my local expert e.
        recv_PE = exchange_counts(send_PE.reshape(-1), self.ep_group).view(P, El)
        in_splits = send_PE.sum(dim=1).tolist()
        out_splits = recv_PE.sum(dim=1).tolist()
        received = all_to_all_rows(rows_NH, out_splits, in_splits, self.ep_group)
        # Received rows are ordered (src, expert); the grouped matmul needs (expert, src).
        segment = torch.repeat_interleave(torch.arange(P * El, device=received.device), recv_PE.reshape(-1))
        by_expert = torch.argsort(segment % El, stable=True)
        grouped = received.index_select(0, by_expert)
        out_grouped = expert_mlp(grouped, gate_up, down, recv_PE.sum(dim=0), self.act_fn)
        out_received = torch.empty_like(out_grouped).index_copy(0, by_expert, out_grouped)
        return all_to_all_rows(out_received, in_splits, out_splits, self.ep_group)
