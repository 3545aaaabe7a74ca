"""shardforge.moe_ep: expert parallelism for HF fused-expert MoE blocks.

- `apply_expert_parallel`: experts split on dim 0 over ``ep`` (DTensors, global names),
  all-to-all token dispatch/combine, grouped matmul, the EP / expert-TP strategy table.
- `expert_modules`: the experts modules, for expert FSDP over ``efsdp``.
- `RouterRecorder`: the global load-balancing loss and router statistics.
- `RouterReplay`: record each token's top-k experts (rollout) and route a later forward the same
  way (R3 router replay for RL).
- `validate_expert_parallel`: layout checks before any collective.
- `checkpoint_view`, `broadcast_full_tensors_`, `register_optimizer_checkpoint_hooks`: correct
  DCP / full-state-dict loading of expert-TP (``_StridedShard``) parameters.
"""

import importlib as _importlib
import typing as _typing

from shardforge.moe_ep.families import MOE_FAMILIES, MoEFamily, find_moe_blocks, supported_moe_families
from shardforge.moe_ep.grouped import expert_mlp, grouped_linear, grouped_mm_available
from shardforge.moe_ep.replay import RouterReplay
from shardforge.moe_ep.router import AuxLoss, RouterRecorder

if _typing.TYPE_CHECKING:
    from shardforge.moe_ep.apply import apply_expert_parallel, expert_modules, validate_expert_parallel
    from shardforge.moe_ep.experts import ParallelExperts
    from shardforge.moe_ep.strided import (
        broadcast_full_tensors_,
        checkpoint_view,
        load_full_tensor_,
        register_optimizer_checkpoint_hooks,
    )

# The DTensor-based modules load on first use (PEP 562): the launching `shardforge` process reads
# `MOE_FAMILIES` for its layout checks without importing DTensor.
_LAZY = {
    **dict.fromkeys(("apply_expert_parallel", "expert_modules", "validate_expert_parallel"), "shardforge.moe_ep.apply"),
    "ParallelExperts": "shardforge.moe_ep.experts",
    **dict.fromkeys(
        ("broadcast_full_tensors_", "checkpoint_view", "load_full_tensor_", "register_optimizer_checkpoint_hooks"),
        "shardforge.moe_ep.strided",
    ),
}

__version__ = "0.1.0"

__all__ = [
    "MOE_FAMILIES",
    "AuxLoss",
    "MoEFamily",
    "ParallelExperts",
    "RouterRecorder",
    "RouterReplay",
    "apply_expert_parallel",
    "broadcast_full_tensors_",
    "checkpoint_view",
    "expert_mlp",
    "expert_modules",
    "find_moe_blocks",
    "grouped_linear",
    "grouped_mm_available",
    "load_full_tensor_",
    "register_optimizer_checkpoint_hooks",
    "supported_moe_families",
    "validate_expert_parallel",
]


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
