"""Reward-model training: preference pairs -> Bradley-Terry loss on a value-head `TrainEngine`.

Rows (JSONL): ``{"prompt": ..., "chosen": ..., "rejected": ...}``. Each side is tokenised as
``<bos> prompt response <eos>`` and scored by the value head at its last token. A pair's two
sequences are packed next to each other with one ``sequence_group`` id, so the engine keeps
them in one micro-batch; the loss is the sum of ``-log sigmoid(s_chosen - s_rejected)`` over
pairs, normalised by the global number of pairs (the engine contract), so any micro-batching
or data-parallel split gives the same update.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from shardforge.algorithms.batching import SEQUENCE_GROUP, PackedBatch, pack_sequences
from shardforge.algorithms.config_io import config_to_dict
from shardforge.algorithms.data import GlobalBatchSampler
from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.engine.config import EngineConfig
from shardforge.algorithms.metrics import MetricsLogger
from shardforge.algorithms.objectives import bradley_terry_loss, last_token_scores, summarize_stats
from shardforge.algorithms.objectives.stats import merge_stats
from shardforge.algorithms.ppo_step import dp_reduce_stats
from shardforge.algorithms.sft import _check_data_state, _truncate_metrics
from shardforge.algorithms.trainer_common import progress_bar, with_total_steps
from shardforge.checkpoint_dcp import Checkpointer

__all__ = ["IS_CHOSEN", "BradleyTerryLossFn", "PreferencePair", "RMConfig", "load_pairs", "pack_pairs", "run_rm"]

IS_CHOSEN = "is_chosen"
"""Per-sequence [N] extra: 1 for a chosen response, 0 for a rejected one (pairs are consecutive)."""
PAIR_WEIGHT = "pair_weight"
"""Per-sequence [N] extra: 1, or 0 for a placeholder pair that must not count."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RMConfig:
    """Everything `shardforge train rm` needs; YAML keys mirror these fields."""

    model: str
    """HF model directory to start from: a causal LM (new value head) or a reward model."""
    train_file: str
    """Preference JSONL: {"prompt", "chosen", "rejected"} strings."""
    output_dir: str
    """Metrics, checkpoints and the exported reward model."""
    tokenizer: str | None = None
    """Tokenizer directory; None = the model directory."""
    eval_file: str | None = None
    """Held-out preference JSONL for eval loss and accuracy."""
    layout: str = "d-1"
    """Parallel layout (no pp)."""
    steps: int = 100
    """Optimizer steps."""
    global_batch_size: int = 16
    """Pairs per optimizer step, across all data-parallel ranks."""
    max_seq_len: int | None = None
    """Truncate longer sequences (keeping the end, where the score is read); None = keep."""
    margin: float | None = None
    """Optional constant margin in the loss: -log sigmoid(s_c - s_r - margin)."""
    eval_every: int = 0
    """Eval every this many steps (0 = only at the end, when eval_file is set)."""
    eval_batch_size: int = 32
    """Pairs per eval batch."""
    log_every: int = 1
    """Write train metrics every this many steps."""
    seed: int = 0
    """Data-order seed."""
    export_hf_at_end: bool = True
    """Write an HF token-classification model directory to output_dir/hf at the end."""
    save_every: int = 0
    """DCP checkpoint every this many steps (0 = never)."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest committed checkpoint in output_dir/checkpoints."""
    keep_last: int = 2
    """Committed checkpoints to keep."""
    progress: bool = True
    """Progress bar on rank 0."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine settings (head is forced to "value")."""


@dataclass(frozen=True, slots=True)
class PreferencePair:
    """Token ids of the chosen and the rejected sequence (prompt + response each)."""

    chosen: list[int]
    rejected: list[int]


def load_pairs(path: str | Path, tokenizer: Any, *, max_seq_len: int | None = None) -> list[PreferencePair]:
    """Read and tokenise preference JSONL; malformed rows raise `ValueError` naming the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"preference file {str(path)!r} does not exist")
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    suffix = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pairs, truncated = [], 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not all(isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")):
            raise ValueError(f"line {number} of {path.name}: need string 'prompt', 'chosen' and 'rejected' fields")
        prompt = prefix + tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        sides = []
        for key in ("chosen", "rejected"):
            ids = prompt + tokenizer(row[key], add_special_tokens=False)["input_ids"] + suffix
            if max_seq_len is not None and len(ids) > max_seq_len:
                truncated += 1
                ids = ids[-max_seq_len:]
            sides.append(ids)
        pairs.append(PreferencePair(sides[0], sides[1]))
    if not pairs:
        raise ValueError(f"preference file {str(path)!r} has no rows")
    if truncated:
        warnings.warn(
            f"{truncated} sequence(s) of {path.name} truncated to their last {max_seq_len} tokens", stacklevel=2
        )
    return pairs


def pack_pairs(pairs: Sequence[PreferencePair], indices: Sequence[int], *, weight: float = 1.0) -> PackedBatch:
    """Pack pairs ``indices`` as [chosen_0, rejected_0, chosen_1, ...] with pair extras."""
    sequences = [ids for i in indices for ids in (pairs[i].chosen, pairs[i].rejected)]
    batch = pack_sequences(sequences)
    n = len(sequences)
    batch.extras = {
        SEQUENCE_GROUP: torch.arange(n, dtype=torch.long) // 2,
        IS_CHOSEN: (torch.arange(n) % 2 == 0).float(),
        PAIR_WEIGHT: torch.full((n,), float(weight)),
    }
    return batch


class BradleyTerryLossFn:
    """`bradley_terry_loss` over the pairs of a micro-batch, for a value-head engine."""

    def __init__(self, margin: float | None = None) -> None:
        self.margin = margin
        self._stats: list[dict[str, torch.Tensor]] = []

    def __call__(self, values: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        if IS_CHOSEN not in mb.extras:
            return (values * 0.0).sum()  # the engine's placeholder micro-batch
        chosen = mb.extras[IS_CHOSEN]
        if mb.num_sequences % 2 or not bool((chosen[0::2] == 1).all() and (chosen[1::2] == 0).all()):
            raise ValueError(
                "a micro-batch must hold whole (chosen, rejected) pairs in that order; pack with pack_pairs "
                "(its sequence_group extra keeps pairs together)"
            )
        keep = mb.extras[PAIR_WEIGHT][0::2] > 0
        if not bool(keep.any()):
            return (values * 0.0).sum()
        scores = last_token_scores(values, mb.cu_seqlens)
        out = bradley_terry_loss(scores[0::2][keep], scores[1::2][keep], margin=self.margin)
        self._stats.append(out.stats)
        return out.loss_sum

    def loss_weight(self, mb: PackedBatch) -> torch.Tensor:
        if PAIR_WEIGHT not in mb.extras:
            return torch.zeros((), dtype=torch.float64)
        return (mb.extras[PAIR_WEIGHT][0::2] > 0).sum().double()

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Merged pair-sum stats since the last call (this rank), then reset. Every rank has the keys."""
        merged = merge_stats(self._stats)
        self._stats = []
        for key in ("num_pairs", "loss_sum", "loss_weight", "accuracy", "chosen_score", "rejected_score", "score_gap"):
            merged.setdefault(key, torch.zeros((), dtype=torch.float64))
        return merged


def _pair_stats(loss_fn: BradleyTerryLossFn, engine: TrainEngine) -> dict[str, float]:
    stats = summarize_stats(dp_reduce_stats(loss_fn.pop_stats(), engine), per="num_pairs")
    return {k: stats[k] for k in ("accuracy", "chosen_score", "rejected_score", "score_gap", "num_pairs")}


def _check_lengths(pairs: list[PreferencePair], budget: int, name: str) -> None:
    longest = max(len(p.chosen) + len(p.rejected) for p in pairs)
    if longest > budget:
        raise ValueError(
            f"a pair of {name} has {longest} tokens (chosen + rejected, kept in one micro-batch) but "
            f"engine.max_tokens_per_microbatch={budget}; raise the budget to >= {longest} or set max_seq_len"
        )


def run_rm(config: RMConfig) -> dict[str, Any]:
    """Train a reward model; return a summary (loss/accuracy, paths). Call on every rank."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    train = load_pairs(config.train_file, tokenizer, max_seq_len=config.max_seq_len)
    held_out = load_pairs(config.eval_file, tokenizer, max_seq_len=config.max_seq_len) if config.eval_file else None
    budget = config.engine.max_tokens_per_microbatch
    _check_lengths(train, budget, config.train_file)
    if held_out is not None:
        _check_lengths(held_out, budget, str(config.eval_file))
    engine_config = with_total_steps(dataclasses.replace(config.engine, head="value"), config.steps)
    engine = TrainEngine(config.model, config.layout, engine_config)
    if config.global_batch_size < engine.dp_size:
        raise ValueError(f"global_batch_size={config.global_batch_size} pairs < data-parallel size {engine.dp_size}")
    out = Path(config.output_dir)
    if engine.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config_to_dict(config), indent=2))
    sampler = GlobalBatchSampler(len(train), config.global_batch_size, seed=config.seed)
    data_state = {"seed": config.seed, "global_batch_size": config.global_batch_size, "num_examples": len(train)}
    checkpointer = None
    if config.save_every > 0 or config.resume == "auto":
        checkpointer = Checkpointer(out / "checkpoints", keep_last=config.keep_last)
    start = 0
    if checkpointer is not None and config.resume == "auto":
        saved = engine.load(checkpointer)
        if saved is not None:
            _check_data_state(saved, data_state)
            start = engine.step
    if engine.is_main:
        _truncate_metrics(out / "metrics.jsonl", start)
    metrics = MetricsLogger(out, enabled=engine.is_main)
    loss_fn = BradleyTerryLossFn(config.margin)
    summary: dict[str, Any] = {"steps": config.steps, "output_dir": str(out), "layout": engine.dims.to_string()}
    if start:
        summary["resumed_from"] = start
    bar = progress_bar(config.steps, start, engine.is_main and config.progress, "rm")
    try:
        for step in range(start, config.steps):
            indices = sampler.local_batch(step, engine.dp_rank, engine.dp_size)
            stats = engine.train_batch(pack_pairs(train, indices), loss_fn, loss_fn.loss_weight)
            if not math.isfinite(stats["loss"]):
                raise FloatingPointError(f"loss became {stats['loss']} at step {step + 1}; lower the learning rate")
            stats |= _pair_stats(loss_fn, engine)
            stats["tokens_per_s"] = stats["tokens"] / max(stats["step_time_s"], 1e-9)
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                metrics.log(step + 1, stats)
            summary["train_loss"], summary["train_accuracy"] = stats["loss"], stats["accuracy"]
            if bar is not None:
                bar.set_postfix(loss=f"{stats['loss']:.4f}", acc=f"{stats['accuracy']:.3f}")
                bar.update(1)
            last = step + 1 == config.steps
            if checkpointer is not None and config.save_every > 0 and ((step + 1) % config.save_every == 0 or last):
                engine.save(checkpointer, data_state)
            if held_out is not None and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
                result = evaluate_pairs(engine, held_out, config.eval_batch_size, config.margin)
                metrics.log(step + 1, result, split="eval")
                summary["eval_loss"], summary["eval_accuracy"] = result["loss"], result["accuracy"]
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
    if checkpointer is not None:
        checkpointer.close()
    if config.export_hf_at_end:
        engine.export_hf(out / "hf", tokenizer=tokenizer)
        summary["hf_dir"] = str(out / "hf")
    if engine.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if dist.is_initialized():
        dist.barrier()
    return summary


def evaluate_pairs(
    engine: TrainEngine, pairs: list[PreferencePair], batch_size: int, margin: float | None = None
) -> dict[str, float]:
    """Global Bradley-Terry loss and accuracy on ``pairs`` (split across data-parallel ranks)."""
    loss_fn = BradleyTerryLossFn(margin)
    loss_sum = weight_sum = 0.0
    for begin in range(0, len(pairs), batch_size):
        chunk = list(range(begin, min(begin + batch_size, len(pairs))))
        mine = chunk[engine.dp_rank :: engine.dp_size]
        # A rank without a share still runs (collectives must match) on a zero-weight pair.
        batch = pack_pairs(pairs, mine or chunk[:1], weight=1.0 if mine else 0.0)
        stats = engine.eval_batch(batch, loss_fn, loss_fn.loss_weight)
        loss_sum += stats["loss"] * stats["loss_weight"]
        weight_sum += stats["loss_weight"]
    result = _pair_stats(loss_fn, engine)
    return {"loss": loss_sum / max(weight_sum, 1e-12), **result}


from shardforge.algorithms.trainers import TrainerSpec  # noqa: E402

TRAINER = TrainerSpec(config_cls=RMConfig, run=run_rm)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
