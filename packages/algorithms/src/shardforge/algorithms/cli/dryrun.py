"""``shardforge train ... --dry-run``: what a run would do, without starting it.

Runs in the launching process after the preflight checks: prints the resolved config (overrides
and defaults applied, as `config.json` will hold it), the layout over the ranks, the per-rank
memory the planner predicts for that layout and engine settings, and the data sources with
their row counts. No process group, no model weights, no tokenisation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardforge.algorithms.config_io import config_to_dict
from shardforge.algorithms.data.config import labelled_sources
from shardforge.algorithms.data.sources import is_plain_jsonl, read_source
from shardforge.engine.config import EngineConfig
from shardforge.mesh import ParallelDims

__all__ = ["dry_run_report", "plan_options_for"]


def plan_options_for(engine: EngineConfig) -> Any:
    """The planner's `PlanOptions` for an engine config (micro-batch budget as the sequence length)."""
    import torch

    from shardforge.algorithms.plan import PlanOptions

    lora = engine.lora
    targets = lora.target_modules if lora is not None and not isinstance(lora.target_modules, str) else ()
    return PlanOptions(
        seq_len=engine.max_tokens_per_microbatch,
        micro_batch_tokens=engine.max_tokens_per_microbatch,
        param_dtype=engine.param_dtype,
        compute_dtype=engine.compute_dtype,
        optimizer=engine.optimizer.name,
        activation_checkpointing=engine.activation_checkpointing,
        checkpoint_every=engine.checkpoint_every,
        tiled_mlp_shards=engine.tiled_mlp_shards,
        cpu_offload=engine.cpu_offload,
        lora_rank=lora.r if lora is not None else 0,
        lora_targets=tuple(targets) or ("q_proj", "v_proj"),
        sequence_parallel=engine.sequence_parallel,
        reshard_after_forward=engine.reshard_after_forward,
        fsdp_layers_per_unit=engine.fsdp_layers_per_unit,
        fsdp_forward_prefetch=engine.fsdp_forward_prefetch,
        attention="flash" if torch.cuda.is_available() else "cpu",
        pp_schedule=engine.pp_schedule,
    )


def _rows(path: str) -> int:
    with Path(path).open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def _memory_lines(config: Any, dims: ParallelDims, world: int) -> list[str]:
    from shardforge.algorithms.plan import load_model_config, model_stats, plan_layouts
    from shardforge.algorithms.plan.report import format_table

    engine: EngineConfig = config.engine
    result = plan_layouts(model_stats(load_model_config(config.model)), world, plan_options_for(engine),
                          layouts=[config.layout])  # fmt: skip
    mode = engine.data_parallel
    rows = [e for e in result.fitting if getattr(e, "data_parallel", "fsdp") == mode] or result.fitting
    return [
        f"predicted per-rank memory at the peak (planner; activations for one micro-batch of "
        f"{engine.max_tokens_per_microbatch} tokens):",
        format_table(rows[:1], None),
    ]


def dry_run_report(config: Any, dims: ParallelDims, nproc: int) -> str:
    """The text ``--dry-run`` prints (stdout)."""
    lines = ["resolved config (written to output_dir/config.json by a real run):"]
    lines.append(json.dumps(config_to_dict(config), indent=2))
    lines.append(f"layout: {config.layout} -> {dims.to_string()} over {nproc} rank(s)")
    try:
        lines += _memory_lines(config, dims, nproc)
    except Exception as exc:
        lines.append(f"predicted memory: not available ({type(exc).__name__}: {exc})")
    lines.append("data:")
    mix = getattr(getattr(config, "data", None), "mix", ())
    total = sum(s.weight for s in mix)
    for role, source in labelled_sources(config):
        rows = _rows(source.source) if is_plain_jsonl(source) else len(read_source(source))
        share = (
            f", weight {source.weight:g} = {source.weight / total:.0%} of samples"
            if role.startswith("data.mix")
            else ""
        )
        label = f" [{source.name}]" if source.name else ""
        lines.append(f"  {role}{label}: {source.describe()} ({rows} rows{share})")
    for path in getattr(config, "eval_files", ()):
        lines.append(f"  eval_files: {path} ({_rows(path)} rows)")
    lines.append("dry run: nothing was started (drop --dry-run to train)")
    return "\n".join(lines)
