"""Supervised fine-tuning: JSONL -> packed batches -> `TrainEngine`, with eval and metrics."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from shardforge.algorithms.config_io import config_to_dict
from shardforge.algorithms.data import GlobalBatchSampler, SFTExample, load_sft_examples, pack_examples
from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.engine.config import EngineConfig
from shardforge.algorithms.metrics import MetricsLogger
from shardforge.algorithms.trainer_common import progress_bar, with_total_steps
from shardforge.checkpoint_dcp import Checkpointer

__all__ = ["SFTConfig", "run_sft"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SFTConfig:
    """Everything `shardforge train sft` needs; YAML keys mirror these fields."""

    model: str
    """HF model directory to start from (config.json + safetensors)."""
    train_file: str
    """JSONL with prompt/completion or messages rows."""
    output_dir: str
    """Where metrics, TensorBoard logs and the exported model go."""
    tokenizer: str | None = None
    """Tokenizer directory; None = the model directory."""
    eval_file: str | None = None
    """Optional held-out JSONL for periodic eval loss."""
    layout: str = "d-1"
    """Parallel layout, e.g. 'd2' (FSDP 2), 'r2d2' (HSDP); d-1 = all ranks FSDP."""
    steps: int = 100
    """Optimizer steps."""
    global_batch_size: int = 32
    """Sequences per optimizer step, across all data-parallel ranks."""
    max_seq_len: int | None = None
    """Truncate longer examples; None = keep (they must fit the micro-batch budget)."""
    eval_every: int = 0
    """Run eval every this many steps (0 = only at the end, when eval_file is set)."""
    eval_batch_size: int = 64
    """Sequences per eval batch."""
    log_every: int = 1
    """Write train metrics every this many steps."""
    seed: int = 0
    """Data-order seed."""
    export_hf_at_end: bool = True
    """Write an HF model directory to output_dir/hf after the last step."""
    save_every: int = 0
    """Save a DCP checkpoint to output_dir/checkpoints every this many steps (0 = never)."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest committed checkpoint in output_dir/checkpoints, if any."""
    keep_last: int = 2
    """Committed checkpoints to keep."""
    async_checkpoint: Literal["off", "async", "async_pinned"] = "off"
    """Write checkpoints in the background (committed before the next save and at the end)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine settings (optimizer, schedule, dtype, micro-batch budget, ...)."""


def _check_lengths(examples: list[SFTExample], budget: int, name: str) -> None:
    longest = max(len(e.input_ids) for e in examples)
    if longest > budget:
        count = sum(len(e.input_ids) > budget for e in examples)
        raise ValueError(
            f"{count} example(s) in {name} are longer than engine.max_tokens_per_microbatch={budget} "
            f"(longest: {longest} tokens); raise engine.max_tokens_per_microbatch to >= {longest} or set "
            f"max_seq_len to truncate"
        )


def run_sft(config: SFTConfig) -> dict[str, Any]:
    """Train; return a summary (final train/eval loss, steps, output paths). Call on every rank."""
    from transformers import AutoTokenizer

    tokenizer_dir = config.tokenizer or config.model
    if not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"tokenizer directory {tokenizer_dir!r} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    # Data problems are found before any process group exists.
    train = load_sft_examples(config.train_file, tokenizer, max_seq_len=config.max_seq_len)
    evaluation = (
        load_sft_examples(config.eval_file, tokenizer, max_seq_len=config.max_seq_len) if config.eval_file else None
    )
    budget = config.engine.max_tokens_per_microbatch
    _check_lengths(train, budget, config.train_file)
    if evaluation is not None:
        _check_lengths(evaluation, budget, str(config.eval_file))
    engine_config = with_total_steps(config.engine, config.steps)
    engine = TrainEngine(config.model, config.layout, engine_config)
    out = Path(config.output_dir)
    if engine.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config_to_dict(config), indent=2))
    sampler = GlobalBatchSampler(len(train), config.global_batch_size, seed=config.seed)
    data_state = {"seed": config.seed, "global_batch_size": config.global_batch_size, "num_examples": len(train)}
    checkpointer = None
    if config.save_every > 0 or config.resume == "auto":
        checkpointer = Checkpointer(out / "checkpoints", keep_last=config.keep_last, async_mode=config.async_checkpoint)
    start = 0
    if checkpointer is not None and config.resume == "auto":
        saved = engine.load(checkpointer)
        if saved is not None:
            _check_data_state(saved, data_state)
            start = engine.step
            if engine.is_main:
                print(f"[shardforge] resumed from {checkpointer.path(start)} at step {start}", flush=True)
    if engine.is_main:
        # Records past the starting step belong to an earlier (interrupted or finished) run in
        # the same output_dir; a fresh start (step 0) begins a new metrics file.
        _truncate_metrics(out / "metrics.jsonl", start)
    metrics = MetricsLogger(out, enabled=engine.is_main)
    summary: dict[str, Any] = {"steps": config.steps, "output_dir": str(out), "layout": engine.dims.to_string()}
    if start:
        summary["resumed_from"] = start
    bar = progress_bar(config.steps, start, engine.is_main and config.progress, "sft")
    try:
        for step in range(start, config.steps):
            indices = sampler.local_batch(step, engine.dp_rank, engine.dp_size)
            stats = engine.train_batch(pack_examples(train, indices))
            if not math.isfinite(stats["loss"]):
                raise FloatingPointError(f"loss became {stats['loss']} at step {step + 1}; lower the learning rate")
            stats["tokens_per_s"] = stats["tokens"] / max(stats["step_time_s"], 1e-9)
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                metrics.log(step + 1, stats)
            summary["train_loss"] = stats["loss"]
            if bar is not None:
                bar.set_postfix(loss=f"{stats['loss']:.4f}", tok_s=f"{stats['tokens_per_s']:.0f}")
                bar.update(1)
            last = step + 1 == config.steps
            if checkpointer is not None and config.save_every > 0 and ((step + 1) % config.save_every == 0 or last):
                engine.save(checkpointer, data_state)
            if evaluation is not None and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
                summary["eval_loss"] = _evaluate(engine, evaluation, config, metrics, step + 1)
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
    if checkpointer is not None:
        checkpointer.close()
    if config.export_hf_at_end:
        hf_dir = out / "hf"
        engine.export_hf(hf_dir, tokenizer=tokenizer)
        summary["hf_dir"] = str(hf_dir)
        if engine.config.lora is not None:  # also the adapters alone, in PEFT format
            engine.export_lora(out / "lora", base_model_name_or_path=config.model)
            summary["lora_dir"] = str(out / "lora")
    if engine.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if dist.is_initialized():
        dist.barrier()
    return summary


def _evaluate(
    engine: TrainEngine, examples: list[SFTExample], config: SFTConfig, metrics: MetricsLogger, step: int
) -> float:
    loss_sum, weight_sum = 0.0, 0.0
    for start in range(0, len(examples), config.eval_batch_size):
        chunk = list(range(start, min(start + config.eval_batch_size, len(examples))))
        mine = chunk[engine.dp_rank :: engine.dp_size]
        batch = pack_examples(examples, mine or chunk[:1])
        if not mine:
            # A rank with no share still runs (collectives must match) with zero weight.
            batch.loss_mask.zero_()
        stats = engine.eval_batch(batch)
        loss_sum += stats["loss"] * stats["loss_weight"]
        weight_sum += stats["loss_weight"]
    loss = loss_sum / max(weight_sum, 1e-12)
    metrics.log(step, {"loss": loss}, split="eval")
    return loss


def _check_data_state(saved: dict[str, Any], current: dict[str, Any]) -> None:
    changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if changed:
        details = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in changed.items())
        raise ValueError(
            f"cannot resume: the data order differs from the checkpoint ({details}); restore those settings "
            "or start a fresh run (resume=never or a new output_dir)"
        )


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric records past the resumed step (they belong to the interrupted run)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


from shardforge.algorithms.trainers import TrainerSpec  # noqa: E402

TRAINER = TrainerSpec(config_cls=SFTConfig, run=run_sft)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
