"""The planner's prediction for an image-text model's step, and the storage-tracked measurement of the same
step on CPU (`plan.vision` has the vision terms; benchmarks/bench_vlm.py and tests compare the two)."""

from __future__ import annotations

import gc
from typing import Any, Literal

from shardforge.algorithms.plan.options import PlanOptions

__all__ = [
    "measure_vlm_layout",
    "measure_vlm_on_ranks",
    "measure_vlm_peak",
    "predict_vlm_peak",
    "synthetic_vlm_examples",
]


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
    from shardforge.algorithms.plan.measure import measure_train_peak
    from shardforge.engine import EngineConfig, TrainEngine

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
