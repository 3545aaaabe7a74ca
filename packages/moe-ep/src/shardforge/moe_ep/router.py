"""Load-balancing auxiliary loss and router statistics, global over the data-parallel ranks.

The loss is HF's Switch-Transformer loss (``load_balancing_loss_func`` of Qwen3-MoE,
Mixtral, OLMoE, Qwen2-MoE): over all L MoE layers and all (unmasked) tokens,

    aux = E * sum_e  f_e * P_e,   f_e = C_e / N,   P_e = S_e / N

with C_e the number of top-k assignments to expert e (summed over layers), S_e the summed
router probability of expert e, and N = L x (number of tokens). Computed on one rank's
tokens only, f_e and P_e would be local estimates; here C_e, S_e and N are summed over the
group of ranks holding *different* tokens (dp x cp, the ranks EP exchanges tokens among),
so the value equals HF's loss on the whole global batch. Each rank gets back a *local
share* ``E * sum_e f_e * S_e(local) / N`` whose sum over the group is that loss and whose
gradient (through this rank's router probabilities) is exactly its part of the global
gradient; the counts carry no gradient, as in HF (they come from top-k indices).

`RouterRecorder` hooks each block's router (a forward hook; no patching) and records only
inside ``with recorder.record(...)``, so activation-checkpoint recomputation in backward
is not recorded twice.

Legend: T tokens on this rank, E experts, L MoE layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardforge.moe_ep.families import family_of, find_moe_blocks

__all__ = ["AuxLoss", "RouterRecorder"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AuxLoss:
    """Result of `RouterRecorder.aux_loss`."""

    local: torch.Tensor
    """This rank's differentiable share (sum over the group = the global loss)."""
    value: float
    """The global load-balancing loss (same on every rank)."""
    tokens_per_expert: torch.Tensor
    """[L, E] global top-k assignment counts per layer (int64, CPU)."""
    num_tokens: int
    """Global number of (unmasked) tokens routed in each layer."""
    dropped_tokens: int = 0
    """Tokens dropped for capacity: always 0 (no capacity limit; every assignment is computed)."""

    def stats(self, prefix: str = "moe_") -> dict[str, float]:
        """Flat float metrics: aux loss, load imbalance (max/mean tokens per expert), dropped tokens."""
        counts = self.tokens_per_expert.double()
        mean = counts.mean(dim=1).clamp_min(1e-12)
        return {
            f"{prefix}aux_loss": self.value,
            f"{prefix}tokens_per_expert_min": float(counts.min()) if counts.numel() else 0.0,
            f"{prefix}tokens_per_expert_max": float(counts.max()) if counts.numel() else 0.0,
            f"{prefix}load_imbalance": float((counts.max(dim=1).values / mean).mean()) if counts.numel() else 0.0,
            f"{prefix}dropped_tokens": float(self.dropped_tokens),
        }


class RouterRecorder:
    """Records every MoE router's logits during forward passes run inside `record`.

    Args:
        model: an HF MoE model of a supported family (before or after any parallelism).
    """

    def __init__(self, model: nn.Module) -> None:
        family = family_of(model)
        routers = [getattr(block, family.router_attr) for _, block in find_moe_blocks(model)]
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE blocks to record")
        self.num_experts = int(routers[0].num_experts)
        self.top_k = int(routers[0].top_k)
        self.num_layers = len(routers)
        self._active = False
        self._logits: list[torch.Tensor] = []
        self._mask: torch.Tensor | None = None
        self._handles: list[RemovableHandle] = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._active:
            self._logits.append(output[0] if isinstance(output, tuple) else output)

    @contextmanager
    def record(self, token_mask: torch.Tensor | None = None) -> Iterator[RouterRecorder]:
        """Record router logits of forwards inside the block; ``token_mask`` [T] (1 = count the
        token, 0 = padding) applies to every layer, like HF's ``attention_mask``."""
        self._logits = []
        self._mask = token_mask
        self._active = True
        try:
            yield self
        finally:
            self._active = False

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()

    @property
    def recorded_rows(self) -> int:
        """Tokens each MoE layer routed in the last `record` block (0 if nothing was recorded)."""
        return int(self._logits[0].shape[0]) if self._logits else 0

    def aux_loss(self, group: dist.ProcessGroup | None = None, *, token_mask: torch.Tensor | None = None) -> AuxLoss:
        """The load-balancing loss of the last `record` block, global over ``group``.

        ``token_mask`` [T] overrides the mask given to `record` (useful when the number of
        rows the routers saw is only known after the forward, e.g. after padding).

        Collective over ``group`` (one all-reduce); every rank of the group must call it,
        including ranks whose forward held only padding (``token_mask`` all zero).
        """
        if len(self._logits) != self.num_layers:
            raise RuntimeError(
                f"recorded {len(self._logits)} router calls but the model has {self.num_layers} MoE layers; "
                "run exactly one forward inside `with recorder.record(...)` before aux_loss()"
            )
        E, K = self.num_experts, self.top_k
        device = self._logits[0].device
        mask = token_mask if token_mask is not None else self._mask
        counts = []
        prob_sum = torch.zeros(E, dtype=torch.float32, device=device)
        for logits in self._logits:
            probs_TE = torch.softmax(logits.float(), dim=-1)
            chosen_TK = torch.topk(probs_TE, K, dim=-1).indices
            weight_T = (
                mask.to(device=device, dtype=torch.float32) if mask is not None else probs_TE.new_ones(len(probs_TE))
            )
            counts.append(
                torch.zeros(E, dtype=torch.float32, device=device).index_add_(
                    0, chosen_TK.reshape(-1), weight_T.repeat_interleave(K)
                )
            )
            prob_sum = prob_sum + (probs_TE * weight_T.unsqueeze(-1)).sum(dim=0)
        tokens = float(mask.sum()) if mask is not None else float(self._logits[0].shape[0])
        counts_LE = torch.stack(counts)
        # One all-reduce carries the counts, the probability sums (detached) and the token count.
        packed = torch.cat([counts_LE.reshape(-1), prob_sum.detach(), counts_LE.new_tensor([tokens])])
        if group is not None:
            dist.all_reduce(packed, group=group)
        n = self.num_layers * E
        counts_LE, total_tokens = packed[:n].view(self.num_layers, E), float(packed[-1])
        global_prob_sum = packed[n:-1]
        rows = max(total_tokens * self.num_layers, 1.0)
        fraction_E = counts_LE.sum(dim=0) / rows
        local = E * torch.sum(fraction_E * (prob_sum / rows))
        value = E * torch.sum(fraction_E * (global_prob_sum / rows))
        self._logits = []
        return AuxLoss(
            local=local,
            value=float(value),
            tokens_per_expert=counts_LE.round().to(torch.int64).cpu(),
            num_tokens=round(total_tokens),
        )
