"""Tensor parallelism for adapted Linears: where ``lora_A`` / ``lora_B`` live given the parent's style.

Megatron-style TP splits a column-parallel Linear's output features and a row-parallel Linear's input
features. The adapters follow the parent so that no extra collective is needed:

- colwise parent (input replicated, output sharded on features): ``lora_A`` [r, in] is replicated and
  ``lora_B`` [out, r] is sharded on dim 0 like the parent weight; ``B(A x)`` is then sharded on the
  output features exactly like ``W x``.
- rowwise parent (input sharded on features, partial-sum output): ``lora_A`` is sharded on dim 1 (its
  input features), so ``A x`` is a partial sum over ranks; ``lora_B`` is replicated and, being linear,
  keeps it partial. The parent's own output reduction (all-reduce, or reduce-scatter under sequence
  parallelism) then sums ``W x + scaling * B A x`` in one collective.

The adapters get no module hooks: `LoRALinear.forward` runs them on the DTensor input the parent's
input hook produced, and the parent's output hook redistributes the sum.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from shardforge.lora.layer import ADAPTER_KEYS, LoRALinear

__all__ = ["AdapterParallel", "LoRAParallel", "adapter_tp_styles", "lora_tp_plan"]


class AdapterParallel(ParallelStyle):
    """Distribute a module's own parameters with one placement and add no hooks (adapters only)."""

    def __init__(self, placement: Placement) -> None:
        super().__init__()
        self.placement = placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            value = distribute_tensor(param, device_mesh, [self.placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(value, requires_grad=param.requires_grad))
        return module

    def __repr__(self) -> str:
        return f"AdapterParallel({self.placement})"


def adapter_tp_styles(parent_style: ParallelStyle) -> dict[str, ParallelStyle]:
    """Styles for ``lora_A`` and ``lora_B`` of a Linear planned with ``parent_style``.

    ColwiseParallel parent -> A replicated, B ``Shard(0)``; RowwiseParallel parent -> A ``Shard(1)``,
    B replicated (see the module docstring for why no extra collective is needed).
    """
    if isinstance(parent_style, ColwiseParallel):
        return {"lora_A": AdapterParallel(Replicate()), "lora_B": AdapterParallel(Shard(0))}
    if isinstance(parent_style, RowwiseParallel):
        return {"lora_A": AdapterParallel(Shard(1)), "lora_B": AdapterParallel(Replicate())}
    raise TypeError(
        f"no LoRA adapter placement for a Linear planned with {type(parent_style).__name__}; "
        "valid parent styles: ColwiseParallel, RowwiseParallel"
    )


class LoRAParallel(ParallelStyle):
    """``parent_style`` applied to an adapted Linear's base weight, plus `adapter_tp_styles` for its adapters.

    torch's Colwise/RowwiseParallel partition every parameter under the module (adapters included, with
    the wrong placement and dotted names it cannot register), so the adapters are detached while the
    parent style runs. On any other module this is ``parent_style`` that keeps frozen parameters frozen.
    """

    def __init__(self, parent_style: ParallelStyle) -> None:
        super().__init__()
        self.parent_style = parent_style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.parent_style.src_data_rank = self.src_data_rank
        # torch's styles re-create parameters with requires_grad=True (e.g. SequenceParallel's replicated
        # norm weights): keep the frozen base frozen.
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
        if not isinstance(module, LoRALinear) or "lora_A" not in module._modules:
            self.parent_style._apply(module, device_mesh)
        else:
            detached: dict[str, Any] = {k: module._modules.pop(k) for k in ADAPTER_KEYS if k in module._modules}
            try:
                self.parent_style._apply(module, device_mesh)
            finally:
                module._modules.update(detached)
            for key, style in adapter_tp_styles(self.parent_style).items():
                parallelize_module(module.get_submodule(key), device_mesh, style, src_data_rank=self.src_data_rank)
        for name, param in module.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
        return module

    def __repr__(self) -> str:
        return f"LoRAParallel({self.parent_style!r})"


def lora_tp_plan(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """A copy of a TP plan (module path -> style) for a model with adapters: every entry becomes a
    `LoRAParallel`, so Colwise/RowwiseParallel entries also place the adapters of the Linears they match
    and no entry unfreezes a frozen base parameter. Entries behave as before on everything else."""
    return {path: style if isinstance(style, LoRAParallel) else LoRAParallel(style) for path, style in plan.items()}
