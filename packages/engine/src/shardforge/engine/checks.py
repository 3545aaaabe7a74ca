"""Every refusal of a layout or feature combination, in one place (the planner calls it too).

`check_engine` runs before any collective, on every rank alike, so a bad setting is one
`ValueError` that says what is wrong and what would be valid, never a hang.
"""

from __future__ import annotations

from typing import Any

from shardforge.engine.config import EngineConfig, parse_dtype
from shardforge.engine.loading import is_vlm
from shardforge.mesh import ParallelDims
from shardforge.moe_ep import MOE_FAMILIES

__all__ = [
    "check_engine",
    "check_features",
    "check_layout",
    "check_pipeline",
    "ignored_without_fsdp",
    "stages_per_rank",
]


def check_engine(dims: ParallelDims, hf_config: Any, config: EngineConfig) -> None:
    """Check a resolved layout and the engine's features against the model; raise `ValueError`."""
    check_features(dims, config)
    if is_vlm(hf_config):
        from shardforge.engine.vision import check_vlm  # the vision stack: only for a VLM
        from shardforge.engine.vision_value import vlm_head_class

        check_vlm(dims, hf_config, vlm_head_class(config.head, getattr(hf_config, "model_type", "?")))
    check_layout(dims, hf_config)
    if dims.pp > 1:
        check_pipeline(dims, hf_config, config)
    if config.router_replay and getattr(hf_config, "model_type", None) not in MOE_FAMILIES:
        raise ValueError(
            f"router_replay replays MoE routing, but model_type={getattr(hf_config, 'model_type', None)!r} is not an "
            f"MoE family ({sorted(MOE_FAMILIES)}); set router_replay=false"
        )


def check_features(dims: ParallelDims, config: EngineConfig) -> None:
    """The feature combinations a layout refuses whatever the model (works on unresolved dims)."""
    if dims.pp > 1:
        if not _head(config).supports_pipeline:
            raise ValueError(
                f"value-head models (EngineConfig.head={config.head!r}) do not support pipeline parallelism "
                f"(pp={dims.pp}); use FSDP/HSDP, TP or CP layouts for the critic / reward model"
            )
    if config.tiled_mlp_shards > 1 and dims.tp > 1 and config.sequence_parallel:
        raise ValueError(
            "tiled_mlp_shards > 1 with tensor parallel needs sequence_parallel=False (the tiled MLP splits "
            "the sequence itself); or set tiled_mlp_shards=1"
        )
    if config.data_parallel == "ddp":
        _check_ddp(dims, config)
    if config.router_replay and (dims.cp > 1 or dims.pp > 1):
        raise ValueError(
            f"router_replay is supported where each MoE block sees its micro-batch's whole sequence: not with "
            f"cp={dims.cp} or pp={dims.pp}; use FSDP, HSDP, TP or EP layouts, or set router_replay=false"
        )
    if config.lora is not None:
        if dims.pp > 1:
            raise ValueError(
                f"engine.lora is not supported with pp={dims.pp} yet (pipeline stages are built from the full "
                "model before adapters exist); use fsdp/tp/cp layouts (e.g. d2t2) or set engine.lora to null"
            )
        if not _head(config).supports_lora:
            raise ValueError(
                f"engine.lora with head={config.head!r} is not supported: the new value head would be frozen; "
                "train value models without LoRA"
            )


def _head(config: EngineConfig) -> Any:
    """The configured head, imported only where a check needs its capabilities: the heads module imports
    the engine's DTensor/FSDP stack, which the launching `shardforge` process (preflight) does without."""
    from shardforge.engine.heads import make_head

    return make_head(config.head)


def _check_ddp(dims: ParallelDims, config: EngineConfig) -> None:
    """DDP replicates the whole model: only replicas (``r``) may be > 1 (-1 = not resolved yet)."""
    others = {"dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp, "pp": dims.pp, "ep": dims.ep}
    sharded = {k: v for k, v in others.items() if v > 1}
    if sharded:
        raise ValueError(
            f"engine.data_parallel=ddp keeps a whole replica of the model on every rank, so the layout may "
            f"only have replicas (letter r, e.g. r2, and d1), got {sharded}; write the layout as r<N> with "
            "--nproc-per-node N, or use data_parallel=fsdp for sharded layouts"
        )
    if config.cpu_offload:
        raise ValueError("engine.data_parallel=ddp keeps the model on the device: cpu_offload needs data_parallel=fsdp")


def ignored_without_fsdp(config: EngineConfig) -> list[str]:
    """Settings that only the FSDP wrapper applies, set here to something that would change a run.

    A single process builds a plain module (no FSDP wrapper), so these do nothing there; the engine
    warns with this list instead of ignoring them silently.
    """
    ignored = []
    if config.compute_dtype and parse_dtype(config.compute_dtype) != parse_dtype(config.param_dtype):
        ignored.append(f"engine.compute_dtype={config.compute_dtype} (the model computes in {config.param_dtype})")
    if config.cpu_offload:
        ignored.append("engine.cpu_offload=true (weights, gradients and optimizer state stay where the model is)")
    return ignored


def check_layout(dims: ParallelDims, hf_config: Any) -> None:
    """Check ``dims`` against the model's shape (heads, layers, experts); raise `ValueError`."""
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    if dims.tp > 1:
        from shardforge.tensor_parallel import validate_tp

        validate_tp(hf_config, dims.tp)
    if dims.cp > 1:
        from shardforge.ulysses_cp import validate_cp

        kv_heads = int(getattr(hf_config, "num_key_value_heads", heads) or heads)
        validate_cp(heads, kv_heads, dims.cp, tp=dims.tp)
    if dims.pp > 1 and layers < dims.pp:
        raise ValueError(
            f"pp={dims.pp} needs at least one decoder layer per stage but the model has {layers} layers; "
            f"valid pp: 1..{layers}"
        )
    _check_moe(dims, hf_config)


def _check_moe(dims: ParallelDims, hf_config: Any) -> None:
    """EP/ETP checks; dense models only need ep == 1."""
    from shardforge.moe_ep import MOE_FAMILIES

    if getattr(hf_config, "model_type", None) not in MOE_FAMILIES:  # `features.moe.is_moe` without FSDP imports
        if dims.ep > 1:
            raise ValueError(
                f"ep={dims.ep} needs a sparse MoE model ({sorted(MOE_FAMILIES)}), got "
                f"model_type={getattr(hf_config, 'model_type', None)!r}; use ep=1"
            )
        return
    if dims.ep > 1 or (dims.tp > 1 and dims.pp == 1):  # EP and/or expert TP
        from shardforge.moe_ep import validate_expert_parallel

        validate_expert_parallel(dims, hf_config)
    if dims.ep > 1 and dims.dp_replicate > 1:
        raise ValueError(
            f"ep={dims.ep} with dp_replicate={dims.dp_replicate} (HSDP) is not supported yet: expert "
            "parameters would need HSDP over (dp_replicate, efsdp); use dp_shard instead of dp_replicate"
        )
    if dims.ep > 1 and dims.pp > 1:
        raise ValueError(f"ep={dims.ep} with pp={dims.pp} is not supported yet; use pp=1 with expert parallelism")


def stages_per_rank(config: EngineConfig) -> int:
    """Pipeline (virtual) stages per rank: the configured count or the schedule's default."""
    from shardforge.pipeline import resolve_schedule

    return config.pp_stages_per_rank or resolve_schedule(config.pp_schedule).default_stages_per_rank


def check_pipeline(dims: ParallelDims, hf_config: Any, config: EngineConfig) -> None:
    """Check the pipeline settings against the model (pp > 1); raise `ValueError`."""
    from shardforge.pipeline import resolve_schedule, split_layers

    spec = resolve_schedule(config.pp_schedule)
    v = stages_per_rank(config)
    if not spec.multi_stage and v != 1:
        raise ValueError(
            f"pp_schedule={spec.name} runs one stage per rank but pp_stages_per_rank={v}; "
            "use Interleaved1F1B or ZBVZeroBubble for virtual stages"
        )
    if spec.name == "ZBVZeroBubble" and v != 2:
        raise ValueError(f"pp_schedule=ZBVZeroBubble needs pp_stages_per_rank=2, got {v}")
    split_layers(int(hf_config.num_hidden_layers), dims.pp * v, config.pp_layers_per_stage)
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError(
            "pp > 1 puts the input embedding and lm_head on different stages, but the model ties them "
            "(tie_word_embeddings=True); use pp=1 or an untied model"
        )
    if dims.cp > 1:
        raise ValueError(f"pp={dims.pp} with cp={dims.cp} is not supported yet; use pp with FSDP/TP (letters p, d, t)")
