"""What the planner knows about a model: its parameters (from a meta-device build) and shapes.

The HF model is built under ``torch.device("meta")`` (no memory, ~a second for 70B), and
every parameter is classified by name: which FSDP unit owns it (a decoder layer, the
embedding, lm_head, the root), how tensor parallelism splits it (the dim the built-in TP
plan shards, see `shardforge.tensor_parallel.plans`), and whether it is an expert tensor.
Identical decoder layers share one `LayerSpec`, so a layout costs O(params per layer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["LayerSpec", "ModelStats", "ParamInfo", "VisionStats", "model_stats"]

# Column-parallel (output features, dim 0) and row-parallel (input features, dim 1) linears.
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")
_VISION_BLOCK = re.compile(r"^model\.visual\.blocks\.(\d+)\.(.+)$")


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One parameter: its global shape and how the built-in plans shard it."""

    name: str
    """Name inside its unit (layer params without the ``model.layers.{i}.`` prefix)."""
    shape: tuple[int, ...]
    """Global (unsharded) shape."""
    tp_dim: int | None
    """Dim the TP plan shards (None = replicated over tp)."""
    expert: bool = False
    """A fused expert tensor [E, ...] (dim 0 split over ep; intermediate dim over expert TP)."""
    expert_tp_dim: int | None = None
    """Dim expert TP splits (the moe intermediate)."""
    lora_target: str | None = None
    """Linear name (q_proj, ...) when this is a linear weight LoRA may target."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """The parameters of one decoder layer, and whether its MLP is a sparse MoE block."""

    params: tuple[ParamInfo, ...]
    moe: bool


@dataclass(frozen=True, slots=True)
class ModelStats:
    """Shapes and parameters of a decoder-only HF model (built on meta)."""

    model_type: str
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qk_norm: bool
    num_experts: int
    top_k: int
    moe_intermediate: int
    embedding: tuple[ParamInfo, ...]
    lm_head: tuple[ParamInfo, ...]
    root: tuple[ParamInfo, ...]
    """Params outside layers, embedding and lm_head (the final norm): the root FSDP unit."""
    layer_specs: tuple[LayerSpec, ...]
    layer_kind: tuple[int, ...]
    """Index into ``layer_specs`` of each decoder layer, in order."""
    hf_config: Any
    vision: VisionStats | None = None
    """The vision tower of an image-text model (its blocks; patch embedding and mergers are in ``root``)."""

    @property
    def num_params(self) -> int:
        outside = sum(p.numel for p in (*self.embedding, *self.lm_head, *self.root))
        blocks = self.vision.depth * sum(p.numel for p in self.vision.block) if self.vision else 0
        return outside + blocks + sum(sum(p.numel for p in self.layer_specs[k].params) for k in self.layer_kind)


@dataclass(frozen=True, slots=True)
class VisionStats:
    """A Qwen2-VL-style vision tower: ``depth`` identical blocks (each its own FSDP unit, replicated over tp)
    over image patches; the patch embedding and the patch mergers belong to the root unit."""

    depth: int
    hidden: int
    heads: int
    intermediate: int
    merge: int
    """spatial_merge_size: a merged (image) token is merge**2 patches."""
    patch_dim: int
    """in_channels x temporal_patch_size x patch_size**2 (one patch's pixel values)."""
    block: tuple[ParamInfo, ...]
    """One block's parameters (names without ``model.visual.blocks.{i}.``)."""


def _classify(rest: str, shape: tuple[int, ...]) -> ParamInfo:
    leaf = rest.split(".")[-2] if rest.endswith((".weight", ".bias")) else rest.split(".")[-1]
    is_bias = rest.endswith(".bias")
    if ".experts." in rest or rest.endswith(("experts.gate_up_proj", "experts.down_proj")):
        # Fused experts: gate_up_proj [E, 2I, H] / down_proj [E, H, I] (moe-ep strategy table).
        inter_dim = 1 if "gate_up" in rest else 2
        return ParamInfo(rest, shape, None, expert=True, expert_tp_dim=inter_dim)
    if leaf in _COLWISE and "shared_expert" not in rest:
        return ParamInfo(rest, shape, 0, lora_target=None if is_bias else leaf)
    if leaf in _ROWWISE and "shared_expert" not in rest:
        return ParamInfo(rest, shape, None if is_bias else 1, lora_target=None if is_bias else leaf)
    return ParamInfo(rest, shape, None)  # norms, router gate: replicated over tp


def model_stats(hf_config: Any) -> ModelStats:
    """Build ``hf_config``'s causal LM (an image-text model: its ``AutoModelForImageTextToText``) on the
    meta device and classify its parameters."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision_config = getattr(hf_config, "vision_config", None)
    text_config = hf_config.get_text_config() if vision_config is not None else hf_config
    with torch.device("meta"):
        auto = AutoModelForImageTextToText if vision_config is not None else AutoModelForCausalLM
        model = auto.from_config(hf_config)
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    hidden = int(text_config.hidden_size)
    head_dim = int(getattr(text_config, "head_dim", None) or hidden // heads)
    get_out = model.get_output_embeddings()
    tied = get_out is not None and get_out.weight is model.get_input_embeddings().weight
    embedding: list[ParamInfo] = []
    lm_head: list[ParamInfo] = []
    root: list[ParamInfo] = []
    layers: dict[int, list[ParamInfo]] = {}
    blocks: dict[int, list[ParamInfo]] = {}
    for name, param in model.named_parameters():  # a tied weight is listed once (as the embedding)
        shape = tuple(int(s) for s in param.shape)
        match = _LAYER.match(name)
        block = _VISION_BLOCK.match(name) if vision_config is not None else None
        if match:
            layers.setdefault(int(match.group(1)), []).append(_classify(match.group(2), shape))
        elif block:
            blocks.setdefault(int(block.group(1)), []).append(ParamInfo(block.group(2), shape, None))
        elif "embed_tokens" in name:
            embedding.append(ParamInfo(name, shape, 0))
        elif name.startswith("lm_head"):
            lm_head.append(ParamInfo(name, shape, 0))
        else:
            root.append(ParamInfo(name, shape, None))
    specs: list[LayerSpec] = []
    kinds: list[int] = []
    for index in sorted(layers):
        spec = LayerSpec(tuple(layers[index]), any(p.expert for p in layers[index]))
        if spec not in specs:
            specs.append(spec)
        kinds.append(specs.index(spec))
    has_qk_norm = any("q_norm" in p.name for s in specs for p in s.params)
    experts = int(getattr(text_config, "num_experts", 0) or 0)
    del model
    return ModelStats(
        model_type=str(hf_config.model_type),
        hidden=hidden,
        num_layers=int(text_config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=int(getattr(text_config, "intermediate_size", 0) or 0),
        vocab=int(text_config.vocab_size),
        tied=bool(tied),
        qk_norm=has_qk_norm,
        num_experts=experts if any(s.moe for s in specs) else 0,
        top_k=int(getattr(text_config, "num_experts_per_tok", 0) or 0),
        moe_intermediate=int(getattr(text_config, "moe_intermediate_size", 0) or 0),
        embedding=tuple(embedding),
        lm_head=tuple(lm_head),
        root=tuple(root),
        layer_specs=tuple(specs),
        layer_kind=tuple(kinds),
        hf_config=hf_config,
        vision=_vision_stats(vision_config, blocks) if vision_config is not None else None,
    )


def _vision_stats(config: Any, blocks: dict[int, list[ParamInfo]]) -> VisionStats:
    if not blocks or any(blocks[i] != blocks[0] for i in blocks):
        raise ValueError(
            f"the planner models vision towers of identical blocks under model.visual.blocks (Qwen2-VL style); "
            f"this {type(config).__name__} has {len(blocks)} blocks there"
        )
    patch = int(config.patch_size)
    return VisionStats(
        depth=len(blocks),
        hidden=int(config.hidden_size),
        heads=int(config.num_heads),
        intermediate=int(config.intermediate_size),
        merge=int(config.spatial_merge_size),
        patch_dim=int(getattr(config, "in_channels", 3)) * int(config.temporal_patch_size) * patch * patch,
        block=tuple(blocks[0]),
    )
