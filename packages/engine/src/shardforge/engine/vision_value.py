"""A value head on an image-text model (PPO's critic for image prompts): `VisionValueHead`.

HF has no token-classification class for Qwen2.5-VL / Qwen3-VL, so the critic is the family's
``AutoModelForImageTextToText`` model with its ``lm_head`` swapped for a ``[hidden] -> 1`` linear (the value
head, with a bias, as HF's ``*ForTokenClassification.score``): ``model(**inputs).logits[0, :, 0]`` are the
per-position values, and everything else (visual inputs, per-sequence mRoPE positions, the dummy image of
a micro-batch without images, frozen vision towers, FSDP units of the vision blocks) is the VLM's LM head
path (`engine.vision.VisionLMHead`). Values are *per position*, as `engine.heads.ValueHead`'s: entry t is the
head's output after reading tokens 0..t.

The head is new whatever ``model`` is (a VLM checkpoint has an LM head, not a value head): it is
initialised from ``EngineConfig.seed`` (N(0, initializer_range) weight, zero bias), so every layout starts
from the same critic. Layouts: FSDP / HSDP / DDP and one process (`engine.vision.check_vlm` refuses tp and
cp for it). Its ``export_hf`` directory holds the VLM config with a one-row ``lm_head``: a critic state for
shardforge, not a model plain transformers can load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardforge.engine.batching import PackedBatch
from shardforge.engine.context import ParallelContext
from shardforge.engine.vision import VisionLMHead

__all__ = ["VLM_HEADS", "VisionValueHead", "make_vlm_head", "vlm_head_class"]


def _swap_in_value_head(model: nn.Module, *, seed: int | None, dtype: torch.dtype) -> nn.Module:
    """Replace ``model.lm_head`` by a [hidden] -> 1 linear (initialised from ``seed`` unless None: meta builds)."""
    hf_config: Any = model.config  # an HF model's config
    text_config: Any = hf_config.get_text_config()
    hidden = int(text_config.hidden_size)
    device = model.get_submodule("lm_head").weight.device
    head = nn.Linear(hidden, 1, bias=True, device=device, dtype=dtype)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        std = float(getattr(text_config, "initializer_range", 0.02))
        with torch.no_grad():
            head.weight.copy_((torch.randn(head.weight.shape, generator=gen) * std).to(dtype))
            head.bias.zero_()
    model.lm_head = head
    return model


class _ValueModelClass:
    """The LM head's model class (`VisionLMHead.model_class`: vision tower on SDPA) whose models carry the value
    head."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def from_config(self, config: Any, *, dtype: torch.dtype, attn_implementation: str) -> Any:
        model = self.base.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
        return _swap_in_value_head(model, seed=None, dtype=dtype)


class VisionValueHead(VisionLMHead):
    """A scalar head on an image-text model: per-position values with the images seen."""

    name = "value"
    supports_model_parallel = False
    supports_lora = False
    has_token_distribution = False
    has_full_distribution = False

    def model_class(self) -> Any:
        return _ValueModelClass(super().model_class())

    def materialize(self, source: Any, hf_config: Any, *, dtype: torch.dtype, attn: str, seed: int) -> Any:
        model = super().materialize(source, hf_config, dtype=dtype, attn=attn, seed=seed)
        return _swap_in_value_head(model, seed=seed, dtype=dtype)

    def tp_plan(self, model: nn.Module, *, sequence_parallel: bool) -> dict[str, Any] | None:
        raise AssertionError("check_vlm refuses tp > 1 for a VLM value head")

    def outputs(
        self, model: nn.Module, ctx: ParallelContext, mb: PackedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if entropy:
            raise ValueError("a value-head engine has no token distribution: its loss_fn cannot want entropy")
        padded = mb.to(ctx.device)
        kwargs, real = self.model_inputs(model, ctx, padded)
        values = model(**kwargs).logits[0, :, 0].float()
        # The dummy image sequence (if any) stays in the graph with weight 0, as for the LM head.
        return values[:real] + values[real:].sum() * 0.0, None


VLM_HEADS: dict[str, type[VisionLMHead]] = {"lm": VisionLMHead, "value": VisionValueHead}
"""``EngineConfig.head`` values for image-text models."""


def vlm_head_class(name: str, kind: str = "vision-language") -> type[VisionLMHead]:
    """The head class ``name`` of an image-text model; `ValueError` naming the valid ones."""
    if name not in VLM_HEADS:
        raise ValueError(f"vision-language models ({kind}) support engine.head {sorted(VLM_HEADS)}, got {name!r}")
    return VLM_HEADS[name]


def make_vlm_head(name: str) -> VisionLMHead:
    """The head for an image-text model (see `VLM_HEADS`)."""
    return vlm_head_class(name)()
