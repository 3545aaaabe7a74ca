"""Vision-language models (Qwen2.5-VL family) in the engine: `VisionLMHead`.

Chosen instead of `LMHead` when the HF config has a ``vision_config`` (``EngineConfig.head="lm"``): it
builds the family's ``AutoModelForImageTextToText`` class and feeds each micro-batch's visual inputs
(``data.vlm.VLM_PIXELS`` / ``VLM_GRIDS`` per-sequence extras) with the packed text.

Packing: the text runs through the packed attention (``cu_seqlens``), so sequences never attend to
each other; the 3-D multimodal rotary positions (mRoPE) are computed per packed sequence, restarting
at 0 (`mrope_position_ids`), so a packed forward equals each sample run alone. The vision tower keeps
SDPA attention: it runs on its own per-image chunks and ignores the text's packed kwargs.

Collectives: every micro-batch runs the vision tower (its blocks are FSDP units, all-gathered on
every rank): one without images (a text-only micro-batch or a rank's placeholder) gets one dummy
black image as an extra packed sequence whose outputs are dropped but kept in the graph with weight 0,
so every rank joins the same all-gathers and reduce-scatters.

Layouts: FSDP / HSDP / DDP, FSDP x TP (`engine.vision_tp`: the language model's TP plan, the vision tower
replicated over TP ranks), FSDP x Ulysses CP (the language model's input and mRoPE positions cut per CP
rank after the image features are merged, `vision_tp.install_sequence_chunking`) and one process; PP, EP
and CP x TP are refused (`check_vlm`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.engine.batching import PackedBatch, sequence_start_mask
from shardforge.engine.batching.visual import VLM_GRIDS, VLM_PIXELS
from shardforge.engine.context import ParallelContext
from shardforge.engine.heads import LMHead
from shardforge.engine.loading import is_model_dir, is_vlm
from shardforge.engine.vision_tp import VLM_TP_FAMILIES, install_sequence_chunking, vlm_tp_plan
from shardforge.tensor_parallel import vocab_parallel_entropy
from shardforge.tensor_parallel.validate import validate_tp
from shardforge.ulysses_cp import gather_sequence, packed_model_kwargs, slice_for_rank

__all__ = ["VISION_TOWERS", "VisionLMHead", "check_vlm", "is_vlm", "mrope_position_ids", "vision_tower"]


def check_vlm(dims: Any, hf_config: Any, head: type[VisionLMHead]) -> None:
    """Refuse what vision-language models do not support yet; raise `ValueError` before any collective."""
    if not is_vlm(hf_config):
        return
    kind = getattr(hf_config, "model_type", None)
    unsupported = {"pp": dims.pp, "ep": dims.ep}
    if dims.cp > 1 and dims.tp > 1:
        unsupported["cp x tp"] = dims.cp * dims.tp
    bad = {k: v for k, v in unsupported.items() if v > 1}
    if bad:
        raise ValueError(
            f"vision-language models ({kind}) support data-parallel layouts (FSDP d, HSDP r x d, DDP r) and "
            f"either tensor parallelism or Ulysses context parallelism composed with them (e.g. d2t2, t2, d2c2, "
            f"c2), not {bad}; use e.g. layout d{dims.world_size} or d{dims.world_size // 2}t2 (see "
            "docs/packages/algorithms-vlm.md)"
        )
    if dims.tp > 1:
        if kind not in VLM_TP_FAMILIES:
            raise ValueError(
                f"tensor parallelism for vision-language models has plans for {sorted(VLM_TP_FAMILIES)}, not "
                f"{kind!r}; use a data-parallel layout (e.g. d{dims.world_size})"
            )
        validate_tp(hf_config.text_config, dims.tp)  # the language model's heads / vocab / MLP split over tp
    if not head.supports_model_parallel and (dims.tp > 1 or dims.cp > 1):
        raise ValueError(
            f"a {head.name} head on a vision-language model ({kind}: PPO's critic) supports data-parallel layouts "
            f"(FSDP d, HSDP r x d, DDP r), not tp={dims.tp} cp={dims.cp}; use layout d{dims.world_size} for the critic"
        )


def _vision_attn(attn: str) -> dict[str, str]:
    # The text model uses the packed attention; the vision tower keeps SDPA (see the module docstring).
    return {"": attn, "text_config": attn, "vision_config": "sdpa"}


def mrope_position_ids(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, grids: torch.Tensor, *, image_token_id: int, merge_size: int
) -> torch.Tensor:
    """[3, T] (temporal, height, width) rotary positions of a packed batch, restarting per sequence.

    Per Qwen2-VL's rule (``get_rope_index``): text tokens advance all three by 1; an image of merged grid
    (t, h, w) at position s gets (s + i_t, s + i_h, s + i_w) for its t*h*w tokens, then text resumes at
    s + max(h, w). ``grids`` is [N, max images, 3] (zero rows = no image), in each sequence's image order.
    """
    out = torch.empty(3, input_ids.numel(), dtype=torch.long)
    image_at = (input_ids == image_token_id).nonzero().flatten().tolist()
    bounds = cu_seqlens.tolist()
    cursor = 0  # index into image_at of the next image token not yet placed
    for seq in range(len(bounds) - 1):
        start, end = bounds[seq], bounds[seq + 1]
        images = iter([g for g in grids[seq].tolist() if g[0] * g[1] * g[2] > 0]) if seq < grids.shape[0] else iter([])
        pos, t = 0, start
        while t < end:
            # A text run up to the next image token (or the sequence end) advances all three by 1 per token.
            while cursor < len(image_at) and image_at[cursor] < t:
                cursor += 1
            stop = min(image_at[cursor], end) if cursor < len(image_at) else end
            if stop > t:
                out[:, t:stop] = torch.arange(pos, pos + stop - t)
                pos, t = pos + stop - t, stop
                continue
            gt, gh, gw = next(images)
            gh, gw = gh // merge_size, gw // merge_size
            tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
            count = gt * gh * gw
            out[:, t : t + count] = torch.stack([tt, hh, ww]).reshape(3, -1) + pos
            pos, t = pos + max(gh, gw), t + count
    return out


def _visual_inputs(mb: PackedBatch) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The micro-batch's pixel values [patches, dim] (None without images) and grids [N, images, 3]."""
    if VLM_GRIDS not in mb.extras:
        return None, torch.zeros(mb.num_sequences, 1, 3, dtype=torch.long)
    grids, pixels = mb.extras[VLM_GRIDS].long(), mb.extras[VLM_PIXELS]
    chunks = []
    for seq in range(grids.shape[0]):
        patches = int(grids[seq].prod(-1).sum())
        if patches:
            chunks.append(pixels[seq, :patches])
    if not chunks:
        return None, grids
    return torch.cat(chunks), grids


class VisionLMHead(LMHead):
    """`LMHead` for image+text models: the ``AutoModelForImageTextToText`` class, visual inputs, mRoPE."""

    name = "lm"
    supports_pipeline = False
    supports_lora = True
    has_full_distribution = False  # `distribution_outputs` is LMHead's text-only forward: not for visual inputs
    supports_prefix_sharing = False  # image tokens and mRoPE positions: not shared
    supports_model_parallel: ClassVar[bool] = True
    """Whether tensor and context parallelism may split this head's model (`check_vlm`)."""

    def distribution_outputs(
        self, model: nn.Module, ctx: ParallelContext, mb: PackedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        raise ValueError("full-vocabulary losses are not supported for image+text models yet; use a per-token loss")

    def model_class(self) -> Any:
        from transformers import AutoModelForImageTextToText

        return _AttnFixed(AutoModelForImageTextToText)

    def tp_plan(self, model: nn.Module, *, sequence_parallel: bool) -> dict[str, Any] | None:
        return vlm_tp_plan(model, sequence_parallel=sequence_parallel)

    def adapt_to_layout(self, model: nn.Module, ctx: ParallelContext) -> None:
        if ctx.dims.cp > 1:  # Ulysses: every CP rank keeps its chunk's gradient; FSDP sums them over cp
            install_sequence_chunking(model, ctx.cp_group, ctx.cp_rank, ctx.dims.cp, cp=True)
        if ctx.dims.tp > 1 and ctx.config.sequence_parallel:
            assert ctx.mesh is not None
            install_sequence_chunking(model, ctx.mesh.get("tp").get_group(), ctx.local_rank("tp"), ctx.dims.tp)

    def keep_input_dtype_classes(self, model: nn.Module) -> tuple[str, ...]:
        """The vision tower's block classes (the FSDP-wrapped classes found under it): FSDP does not cast
        their inputs to the compute dtype, so the fp32 rotary cos/sin reach them unrounded (HF's vision
        attention upcasts q/k and cos/sin to fp32 for the rotation; hidden states are already in the
        compute dtype, cast by the patch embedding)."""
        tower = vision_tower(model)
        wrapped = set(getattr(model, "_no_split_modules", None) or ())
        return tuple(sorted({type(m).__name__ for m in tower.modules() if type(m).__name__ in wrapped}))

    def materialize(self, source: Any, hf_config: Any, *, dtype: torch.dtype, attn: str, seed: int) -> Any:
        from transformers import AutoModelForImageTextToText

        if is_model_dir(source):
            return AutoModelForImageTextToText.from_pretrained(
                source, config=hf_config, dtype=dtype, attn_implementation=_vision_attn(attn)
            )
        torch.manual_seed(seed)
        return AutoModelForImageTextToText.from_config(hf_config, dtype=dtype, attn_implementation=_vision_attn(attn))

    def model_inputs(self, model: nn.Module, ctx: ParallelContext, padded: PackedBatch) -> tuple[dict[str, Any], int]:
        """The model's kwargs for ``padded`` (plus a dummy image sequence when it has no image, then one
        padding sequence up to the layout's token multiple) and the number of its tokens that belong
        to ``padded``."""
        config = _hf_config(model)
        merge = int(config.vision_config.spatial_merge_size)
        image_id = int(config.image_token_id)
        ids, cu = padded.input_ids, padded.cu_seqlens
        pixels, grids = _visual_inputs(padded)
        real = padded.num_tokens
        if pixels is None:  # every rank runs the vision tower on every micro-batch (module docstring)
            dim = int(config.vision_config.in_channels) * int(config.vision_config.temporal_patch_size)
            dim *= int(config.vision_config.patch_size) ** 2
            pixels = torch.zeros(merge * merge, dim, device=ids.device)
            ids = torch.cat([ids, ids.new_full((1,), image_id)])
            cu = torch.cat([cu, cu[-1:] + 1])
            extra = grids.new_zeros(1, *grids.shape[1:])
            extra[0, 0] = torch.tensor([1, merge, merge])
            grids = torch.cat([grids, extra])
        pad = (-ids.numel()) % ctx.token_multiple  # sequence-parallel TP splits the sequence
        if pad:  # its own text-only sequence (token 0), like `pad_to_multiple`
            ids = torch.cat([ids, ids.new_zeros(pad)])
            cu = torch.cat([cu, cu[-1:] + pad])
            grids = torch.cat([grids, grids.new_zeros(1, *grids.shape[1:])])
        flat = torch.stack([g for seq in grids for g in seq if int(g.prod()) > 0])
        positions = mrope_position_ids(ids.cpu(), cu.cpu(), grids.cpu(), image_token_id=image_id, merge_size=merge)
        kwargs = {
            "input_ids": ids[None],
            "position_ids": positions.to(ids.device)[:, None],
            "pixel_values": pixels.to(ids.device),
            "image_grid_thw": flat.to(ids.device),
            "use_cache": False,
            **packed_model_kwargs(cu, cp_group=ctx.cp_group),
        }
        return kwargs, real

    def outputs(
        self, model: nn.Module, ctx: ParallelContext, mb: PackedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        padded = mb.to(ctx.device)  # `model_inputs` pads to the token multiple (after the dummy image)
        kwargs, real = self.model_inputs(model, ctx, padded)
        logits = model(**kwargs).logits[0]  # under CP: this rank's chunk of the sequence
        targets = torch.roll(kwargs["input_ids"][0], -1)
        cp_group = ctx.cp_group
        if cp_group is not None:
            targets = slice_for_rank(targets, ctx.cp_rank, ctx.dims.cp)
        next_logprobs = gather_sequence(self.next_token_logprobs(logits, targets), cp_group)
        # A dummy image sequence (if any) and the padding are dropped, but kept in the graph with weight 0 so its vision
        # parameters get (zero) gradients on this rank like on the others.
        keep = next_logprobs[real:].sum() * 0.0
        starts = sequence_start_mask(padded.cu_seqlens, real)

        def realign(per_position: torch.Tensor) -> torch.Tensor:
            whole = per_position[:real]
            shifted = torch.cat([whole.new_zeros(1), whole[:-1]]).masked_fill(starts, 0.0)
            return shifted + keep

        entropies = None
        if entropy:
            scaled = logits / self.temperature if self.temperature != 1.0 else logits
            if isinstance(scaled, DTensor):  # vocab-sharded logits (TP)
                local = vocab_parallel_entropy(scaled)
            else:
                log_p = torch.log_softmax(scaled.float(), dim=-1)
                local = -(log_p.exp() * log_p).sum(-1)
            entropies = realign(gather_sequence(local, cp_group))
        return realign(next_logprobs), entropies


VISION_TOWERS = ("model.visual", "visual", "model.vision_tower", "vision_tower")
"""Where image-text families keep their vision tower (Qwen2/2.5/3-VL: ``model.visual``; LLaVA-style:
``model.vision_tower``)."""


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision tower of an image-text model (`VISION_TOWERS`); a `ValueError` lists where it looked."""
    for name in VISION_TOWERS:
        try:
            return model.get_submodule(name)
        except AttributeError:
            continue
    raise ValueError(f"{type(model).__name__} has no vision tower at any of {VISION_TOWERS}; add its path there")


def _hf_config(model: nn.Module) -> Any:
    inner = getattr(model, "module", model)  # DDP
    return inner.config


class _AttnFixed:
    """``AutoModelForImageTextToText`` whose ``from_config`` gives the vision tower SDPA attention."""

    def __init__(self, auto: Any) -> None:
        self.auto = auto

    def from_config(self, config: Any, *, dtype: torch.dtype, attn_implementation: str) -> Any:
        return self.auto.from_config(config, dtype=dtype, attn_implementation=_vision_attn(attn_implementation))
