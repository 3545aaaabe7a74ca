"""Checks the `shardforge` CLI runs in the launching process, before torchrun starts any rank.

Everything a user can get wrong and that needs no process group is checked here once, in
seconds, so a mistake is one message instead of a traceback per rank 30 s later: the layout
against ``--nproc-per-node``, the model/tokenizer directories (local only, never a Hub lookup),
the engine's layout/feature checks, the data sources (JSONL: file + 1-based line + expected fields;
others: source, row number and field),
the output directory, and the batch sizes against the data-parallel size.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from shardforge.algorithms.data.config import labelled_sources
from shardforge.algorithms.data.jsonl import RowFields, read_jsonl
from shardforge.algorithms.data.sources import is_plain_jsonl, read_source
from shardforge.core.log import get_logger
from shardforge.engine.checks import check_engine
from shardforge.engine.loading import check_model_dir, load_hf_config
from shardforge.mesh import ParallelDims

__all__ = ["check_layout_for_ranks", "check_output_dir", "needs_model_config", "preflight", "resolve_auto"]


def preflight(config: Any, nproc: int, row_fields: RowFields = (), *, keep_rows: bool = False) -> ParallelDims:
    """Raise `ValueError` / `FileNotFoundError` for the first problem; return the resolved layout.

    ``keep_rows``: this process trains next (one rank, no relaunch): the JSONL rows read here are kept
    for the trainer's own read (`read_jsonl`'s ``keep``) instead of being parsed twice."""
    dims = check_layout_for_ranks(config.layout, nproc)
    hf_config = None
    for name in ("model", *(f.name for f in dataclasses.fields(config) if f.name.endswith("_model"))):
        path = getattr(config, name)
        if name == "reward_model":  # the RL trainers' ``reward_model:`` section holds its path
            name, path = "reward_model.path", getattr(path, "path", None)
        if path is None:
            continue
        if not Path(path).exists():
            raise FileNotFoundError(
                f"{name}={path!r} does not exist (resolved: {Path(path).resolve()}); models are read from local "
                "directories written by `save_pretrained` (`shardforge prepare-tiny` makes tiny ones)"
            )
        check_model_dir(path)
        if hf_config is None and needs_model_config(dims, config.engine):
            hf_config = load_hf_config(path)
    tokenizer = getattr(config, "tokenizer", None)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise FileNotFoundError(f"tokenizer={tokenizer!r} is not a directory; set it to a tokenizer directory or null")
    check_engine(dims, hf_config, config.engine)
    for role, source in labelled_sources(config):  # train_file/eval_file, or data.train/eval/mix sources
        if is_plain_jsonl(source):
            read_jsonl(source.source, role.replace("_", " "), row_fields, keep=keep_rows)
        else:
            read_source(source, row_fields)
    check_output_dir(config.output_dir)
    _check_batch_sizes(config, dims)
    return dims


def needs_model_config(dims: ParallelDims, engine: Any) -> bool:
    """Whether `check_engine` reads the model's config for this layout and engine.

    Only the model-sharding axes (tp, cp, pp, ep), a head other than the LM head (refused for
    vision-language models) and router replay (MoE only) do. A data-parallel run skips loading it
    here: importing transformers' config classes cost this process 2.4-3.5 s of start-up before any
    rank started, and every rank loads the config (and runs the same checks) anyway.
    """
    sharded = max(dims.tp, dims.cp, dims.pp, dims.ep) > 1
    return sharded or engine.head != "lm" or bool(engine.router_replay)


def check_layout_for_ranks(layout: str, nproc: int) -> ParallelDims:
    """The layout resolved for ``nproc`` ranks; a mismatch names the ranks it needs and the fix."""
    dims = ParallelDims.parse(layout)
    try:
        return dims.resolve(nproc)
    except ValueError:
        pass
    fixed = dims.pp * dims.dp_replicate * dims.cp * dims.tp * (1 if dims.dp_shard == -1 else dims.dp_shard)
    need = f"{fixed} ranks" if dims.dp_shard != -1 else f"a multiple of {fixed} ranks"
    raise ValueError(
        f"layout={layout!r} needs {need}, but --nproc-per-node is {nproc}; run with --nproc-per-node {fixed}, "
        f"or pick a layout whose sizes multiply to {nproc} (e.g. layout=d{nproc}; 'd-1' gives FSDP the ranks the "
        "other axes leave)"
    )


def check_output_dir(output_dir: str) -> None:
    """Refuse an output directory that is a file or whose nearest existing parent is not writable."""
    path = Path(output_dir).absolute()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"output_dir={output_dir!r}: {str(probe)!r} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"output_dir={output_dir!r}: {str(probe)!r} is not writable; choose another output_dir")


def _check_batch_sizes(config: Any, dims: ParallelDims) -> None:
    dp = dims.dp
    batch = getattr(config, "global_batch_size", None)
    if batch is not None and batch < dp:
        raise ValueError(
            f"global_batch_size={batch} is smaller than the data-parallel size {dp} of layout {dims.to_string()}; "
            f"use global_batch_size >= {dp}"
        )
    prompts = getattr(config, "prompts_per_step", None)
    if prompts is not None and (prompts < 1 or prompts % dp):
        raise ValueError(
            f"prompts_per_step={prompts} must be a positive multiple of the data-parallel size {dp} "
            f"(every rank samples whole groups); e.g. prompts_per_step={max(dp, prompts - prompts % dp)}"
        )


def resolve_auto(args: Any, config: Any) -> Any:
    """``layout: auto`` -> the planner's best data-parallel layout for this world size (`plan.auto`),
    resolved the same way in the launching process and in every rank; one line on rank 0."""
    if getattr(config, "layout", None) != "auto":
        return config
    from shardforge.algorithms.plan.auto import resolve_auto_layout

    if "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    else:
        from shardforge.algorithms.launch.multinode import launch_spec

        world_size = launch_spec(args).world_size
    config, line = resolve_auto_layout(config, world_size)
    if line and os.environ.get("SHARDFORGE_AUTO_LAYOUT_SHOWN") != line and int(os.environ.get("RANK", "0")) == 0:
        get_logger(__name__).info(line)
    os.environ["SHARDFORGE_AUTO_LAYOUT_SHOWN"] = line or ""  # the ranks the launcher starts do not repeat it
    return config
