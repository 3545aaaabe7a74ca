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
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Literal

from shardforge.algorithms.plan.options import PlanOptions
from shardforge.algorithms.plan.shards import ShardPlan
from shardforge.algorithms.plan.stats import ModelStats

__all__ = ["VisionTerms", "measure_vlm_on_ranks", "measure_vlm_peak", "predict_vlm_peak", "vision_terms"]

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
    from shardforge.algorithms.plan.memory import is_frozen

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


def predict_vlm_peak(
    hf_config: Any,
    layout: str,
    world_size: int,
    *,
    seq_len: int,
    micro_batch_tokens: int,
    vision_patches: int,
    frozen: tuple[str, ...] = (),
    attention: Literal["flash", "cpu"] = "cpu",
) -> Any:
    """The planner's `MemoryEstimate` for an image-text model (fp32, AdamW) with ``vision_patches`` patches
    per micro-batch and the modules ``frozen`` (`measure_vlm_on_ranks` measures the same run)."""
    from shardforge.algorithms.plan.memory import estimate_memory
    from shardforge.algorithms.plan.stats import model_stats
    from shardforge.mesh import ParallelDims

    opts = PlanOptions(
        seq_len=seq_len, micro_batch_tokens=micro_batch_tokens, attention=attention, param_dtype="float32",
        vision_patches=vision_patches, frozen_prefixes=tuple(frozen),
    )  # fmt: skip
    dims = ParallelDims.parse(layout).resolve(world_size)
    return estimate_memory(model_stats(hf_config), dims, opts)


def measure_vlm_peak(
    model_dir: str, examples: list[Any], indices: list[int], *, freeze: tuple[str, ...] = (), layout: str = "d1"
) -> dict[str, Any]:
    """Peak bytes of one steady-state ``train_batch`` of the examples at ``indices`` (one micro-batch) on
    this rank (`plan.measure.measure_train_peak`), for a `TrainEngine` of ``model_dir`` with ``freeze``."""
    import torch

    from shardforge.algorithms.data.vlm import pack_vlm_examples
    from shardforge.algorithms.engine import EngineConfig, TrainEngine
    from shardforge.algorithms.plan.measure import measure_train_peak

    torch.set_num_threads(1)
    batch = pack_vlm_examples(examples, indices)
    config = EngineConfig(max_tokens_per_microbatch=max(batch.num_tokens, 1), freeze_module_prefix=freeze)
    engine = TrainEngine(model_dir, layout, config)
    result = measure_train_peak(engine, batch)
    del engine
    gc.collect()
    return result


def synthetic_vlm_examples(hf_config: Any, count: int, seq_len: int, grid: int, seed: int) -> list[Any]:
    """``count`` examples of ``seq_len`` tokens: random text, one image of grid x grid patches (random pixels)
    after a vision-start token, loss on the second half."""
    import torch

    from shardforge.algorithms.data.vlm import VLMExample

    v = hf_config.vision_config
    image_tokens = grid * grid // int(v.spatial_merge_size) ** 2
    dim = int(getattr(v, "in_channels", 3)) * int(v.temporal_patch_size) * int(v.patch_size) ** 2
    specials = {int(hf_config.image_token_id), int(hf_config.video_token_id), int(hf_config.vision_start_token_id)}
    text_vocab = [t for t in range(int(hf_config.get_text_config().vocab_size)) if t not in specials]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = [text_vocab[int(i)] for i in torch.randint(len(text_vocab), (seq_len,), generator=gen)]
        ids[1] = int(hf_config.vision_start_token_id)
        ids[2 : 2 + image_tokens] = [int(hf_config.image_token_id)] * image_tokens
        mask = [0.0] * (seq_len // 2) + [1.0] * (seq_len - seq_len // 2)
        pixels = torch.randn(grid * grid, dim, generator=gen)
        out.append(VLMExample(ids, mask, pixels, torch.tensor([[1, grid, grid]])))
    return out


def measure_vlm_layout(model_dir: str, layout: str, spec: dict[str, int], freeze: tuple[str, ...]) -> dict[str, Any]:
    """On every rank: `measure_vlm_peak` of ``spec["tokens"] // spec["seq_len"]`` synthetic sequences per
    data-parallel rank (`synthetic_vlm_examples`, seeded by the rank)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from shardforge.mesh import ParallelDims

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.parse(layout).resolve(world)
    count = spec["tokens"] // spec["seq_len"]
    dp_rank = rank // (world // (dims.dp_replicate * dims.dp_shard))
    examples = synthetic_vlm_examples(
        AutoConfig.from_pretrained(model_dir), count, spec["seq_len"], spec["grid"], dp_rank
    )
    result = measure_vlm_peak(model_dir, examples, list(range(count)), freeze=freeze, layout=layout)
    result["rank"] = rank
    return result


def measure_vlm_on_ranks(
    model_dir: str, layout: str, world_size: int, spec: dict[str, int], freeze: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """`measure_vlm_layout` in this process (world 1) or on the shared gloo rank pool; one result per rank."""
    if world_size == 1:
        return [measure_vlm_layout(model_dir, layout, spec, freeze)]
    from shardforge.mesh.testing import get_rank_pool

    return get_rank_pool(world_size).run(measure_vlm_layout, model_dir, layout, spec, freeze, timeout_s=900)
