"""The planner's vision-tower terms for image-text models (Qwen2-VL style), and their CPU measurement.

Legend (per image patch on this rank): hv vision hidden, iv vision MLP width, nh vision heads, d = hv / nh,
a bytes of the compute dtype, P = in_channels x temporal_patch x patch**2 pixel values, m = merge**2
patches per image token.

* **Parameters.** Vision blocks are FSDP units of their own (sharded over fsdp, replicated over tp); the
  patch embedding and the mergers are in the root unit (`stats.model_stats`). Parameters under
  `PlanOptions.frozen_prefixes` (e.g. ``model.visual``) get no gradient and no optimizer state.
* **Pixels.** The micro-batch's per-sequence pixel values ``[N, patches, P]`` and the flat ``[patches, P]``
  concatenation the tower reads (``4 P`` each, fp32; counted for the whole step, also when frozen; the
  per-sequence padding to the longest sequence's patch count is not modelled).
* **Activations** (only when the tower trains: a frozen tower's inputs and weights need no gradient, so
  autograd keeps nothing of it). They are saved in forward, before the language model runs, and freed by
  the tower's backward, which runs last: they are alive at every peak of the text model's step.
  Per block (the HF `Qwen2_5_VLVisionBlock` code path, SDPA over per-image / per-window chunks):
  two RMSNorms ``2 (4 hv + 4 + 2 a hv)``; the qkv output ``3 a hv`` (its q/k/v views are saved); the
  rotary inputs in fp32 (``rotate_half`` results ``8 hv``, the rotated q, k ``8 hv``, and fp32 copies of q,
  k plus bf16 casts of the rotated ones when a != 4); SDPA output ``a hv`` and logsumexp ``4 nh``; the
  proj input ``a hv``; the gated MLP ``4 a iv`` (as a text MLP).
  Once: the patch embedding's input ``4 P`` (a conv weight gradient needs it), cos/sin ``8 d``, the
  merger (RMSNorm ``4 hv + 4 + a hv``, its output, the GELU input and output: ``3 a hv``) and two int64
  window permutation indices ``16 / m``.

`plan.vision_measure` predicts and measures whole VLM steps (benchmarks/bench_vlm.py, tests).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardforge.algorithms.plan.options import PlanOptions, is_frozen
from shardforge.algorithms.plan.shards import ShardPlan
from shardforge.algorithms.plan.stats import ModelStats

__all__ = ["VisionTerms", "vision_block_saved", "vision_once_saved", "vision_terms"]

VISION_PREFIX = "model.visual.blocks.{}."


@dataclass(frozen=True, slots=True)
class VisionTerms:
    """What the vision tower adds to a rank's step (elements for parameters, bytes for activations)."""

    local: int
    """Local parameter elements of the vision blocks (the rest of the tower is in the root unit)."""
    trainable_local: int
    largest_trainable: int
    gathered_block: int
    """Elements of one gathered block (an FSDP unit)."""
    saved_bytes: float
    """Bytes alive from the tower's forward to its backward: the pixel values (module docstring) and, when
    the tower trains, its saved activations."""


def vision_block_saved(stats: ModelStats, a: int) -> float:
    """Bytes per patch one trained vision block keeps for backward (module docstring)."""
    v = stats.vision
    assert v is not None
    hv, iv = v.hidden, v.intermediate
    norm = 4 * hv + 4 + 2 * a * hv
    rotary = 16 * hv + (8 * hv + 2 * a * hv if a != 4 else 0)
    return 2 * norm + 3 * a * hv + rotary + a * hv + 4 * v.heads + a * hv + 4 * a * iv


def vision_once_saved(stats: ModelStats, a: int) -> float:
    """Bytes per patch the trained tower keeps outside its blocks (patch embedding, rotary, merger)."""
    v = stats.vision
    assert v is not None
    merger = 4 * v.hidden + 4 + a * v.hidden + 3 * a * v.hidden
    return 4 * v.patch_dim + 8 * (v.hidden // v.heads) + merger + 16 / (v.merge * v.merge)


def vision_terms(stats: ModelStats, sp: ShardPlan, opts: PlanOptions, a: int) -> VisionTerms:
    """The vision tower's parameters (blocks) and saved activations for ``opts.vision_patches`` patches."""
    v = stats.vision
    assert v is not None
    local = trainable = largest = gathered = 0
    for p in v.block:
        n = sp.local_numel(p)
        local, gathered = local + n, gathered + sp.gathered_numel(p)
        if not is_frozen(VISION_PREFIX.format(0) + p.name, opts.frozen_prefixes) and not opts.lora_rank:
            trainable, largest = trainable + n, max(largest, n)
    trained = trainable > 0
    # The micro-batch's per-sequence pixel values and the flat concatenation the tower reads (fp32, 4 P each):
    # the first lives through the step; the second until the loss (frozen) or the patch embedding's backward,
    # where it is the conv input `vision_once_saved` counts.
    pixels = opts.vision_patches * 4 * v.patch_dim
    saved = opts.vision_patches * (v.depth * vision_block_saved(stats, a) + vision_once_saved(stats, a))
    return VisionTerms(v.depth * local, v.depth * trainable, largest, gathered, pixels + (saved if trained else pixels))
