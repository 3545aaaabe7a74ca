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

from shardforge.moe_ep.apply import apply_expert_parallel, expert_modules, validate_expert_parallel
from shardforge.moe_ep.experts import ParallelExperts
from shardforge.moe_ep.families import MOE_FAMILIES, MoEFamily, find_moe_blocks, supported_moe_families
from shardforge.moe_ep.grouped import expert_mlp, grouped_linear, grouped_mm_available
from shardforge.moe_ep.replay import RouterReplay
from shardforge.moe_ep.router import AuxLoss, RouterRecorder
from shardforge.moe_ep.strided import (
    broadcast_full_tensors_,
    checkpoint_view,
    load_full_tensor_,
    register_optimizer_checkpoint_hooks,
)

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
