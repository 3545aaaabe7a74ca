"""Per-family knowledge, in one table: which module is the MoE block, and its parts' names.

Every family here uses transformers' fused experts layout (``@use_experts_implementation``
with the defaults: ``gate_up_proj [E, 2I, H]`` gate rows first, ``down_proj [E, H, I]``, no
bias) and a top-k router module returning ``(router_logits, top_k_weights, top_k_index)``
that the block calls before ``self.experts(hidden, top_k_index, top_k_weights)``. The router
applies the family's own normalisation (softmax + top-k, ``norm_topk_prob`` where the
family has it), so expert parallelism never re-implements routing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["MOE_FAMILIES", "MoEFamily", "find_moe_blocks", "supported_moe_families"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEFamily:
    """Where a family keeps its MoE parts."""

    block_class: str
    """Class name of the sparse MoE block (``model.layers.*.mlp``)."""
    experts_attr: str = "experts"
    """Attribute of the block holding the fused experts module."""
    router_attr: str = "gate"
    """Attribute of the block holding the top-k router (output index 0: router logits)."""


MOE_FAMILIES: dict[str, MoEFamily] = {
    "qwen3_moe": MoEFamily(block_class="Qwen3MoeSparseMoeBlock"),
    "qwen2_moe": MoEFamily(block_class="Qwen2MoeSparseMoeBlock"),  # + a dense shared expert, left replicated
    "mixtral": MoEFamily(block_class="MixtralSparseMoeBlock"),
    "olmoe": MoEFamily(block_class="OlmoeSparseMoeBlock"),
}
"""HF ``config.model_type`` -> `MoEFamily`."""


def supported_moe_families() -> list[str]:
    return sorted(MOE_FAMILIES)


def family_of(model: nn.Module) -> MoEFamily:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MOE_FAMILIES:
        raise ValueError(
            f"no expert-parallel support for model_type={model_type!r} ({type(model).__name__}); "
            f"supported MoE families: {supported_moe_families()}"
        )
    return MOE_FAMILIES[model_type]


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` for every sparse MoE block of ``model``, in module order."""
    family = family_of(model)
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ == family.block_class]
