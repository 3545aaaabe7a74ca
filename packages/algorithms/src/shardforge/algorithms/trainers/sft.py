"""Supervised fine-tuning: JSONL -> packed batches -> `TrainEngine`, with eval and metrics.

The model decides the rows: a text model reads prompt/completion and chat rows (`TextRows`); a
vision-language model (its config has a ``vision_config``, e.g. Qwen2.5-VL) reads chat rows with image
content parts (`ImageRows`: its image processor from the model directory, images packed with their
sequences; docs/packages/algorithms-vlm.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from shardforge.algorithms.data import SFT_ROW_FIELDS
from shardforge.algorithms.data.config import apply_chat_template_override, eval_source, train_sources
from shardforge.algorithms.data.rows import sft_rows
from shardforge.algorithms.data.source_set import SourceSet, loader_arg
from shardforge.algorithms.data.sources import SourceConfig
from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.base import Trainer
from shardforge.algorithms.trainers.run.common import SourceSetState, check_max_positions, with_total_steps
from shardforge.algorithms.trainers.run.config import TrainerConfig

if TYPE_CHECKING:  # imported in build_engines: the launching process reads SFTConfig without the engine
    from shardforge.engine import TrainEngine

__all__ = ["SFTConfig", "SFTTrainer", "run_sft"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SFTConfig(TrainerConfig):
    """Everything `shardforge train sft` needs (shared fields: `TrainerConfig`)."""

    global_batch_size: int = 32
    """Sequences per optimizer step, across all data-parallel ranks."""
    max_seq_len: int | None = None
    """Truncate longer examples; None = keep (they must fit the micro-batch budget)."""
    eval_batch_size: int = 64
    """Sequences per eval batch."""

    reads_data_sources: ClassVar[bool] = True


def _check_lengths(examples: list[Any], budget: int, name: str) -> None:
    longest = max(len(e.input_ids) for e in examples)
    if longest > budget:
        count = sum(len(e.input_ids) > budget for e in examples)
        raise ValueError(
            f"{count} example(s) in {name} are longer than engine.max_tokens_per_microbatch={budget} "
            f"(longest: {longest} tokens); raise engine.max_tokens_per_microbatch to >= {longest} or set "
            f"max_seq_len to truncate"
        )


class SFTTrainer(SourceSetState, Trainer[SFTConfig]):
    """Next-token loss on the completion / assistant tokens."""

    name = "sft"

    def load_data(self) -> None:
        config = self.config
        apply_chat_template_override(self.tokenizer, config.data.chat_template)
        held_out = eval_source(config)
        self.rows = sft_rows(config.model, self.tokenizer, config.tokenizer)

        def load(source: str | SourceConfig) -> list[Any]:
            return self.rows.load(source, self.tokenizer, config.max_seq_len)

        self.data = SourceSet(
            train_sources(config), load, config.global_batch_size, seed=config.seed, mix=bool(config.data.mix)
        )
        self.train, self.names = self.data.items, self.data.names
        self.held_out = load(loader_arg(held_out)) if held_out else None
        budget = config.engine.max_tokens_per_microbatch
        for examples, name in zip(self.data.per_source, self.names):
            _check_lengths(examples, budget, name)
        if self.held_out is not None and held_out is not None:
            _check_lengths(self.held_out, budget, held_out.label)

    def build_engines(self) -> TrainEngine:
        from shardforge.engine import TrainEngine

        config = self.config
        engine = TrainEngine(config.model, config.layout, with_total_steps(config.engine, config.steps))
        held_out = eval_source(config)
        for examples, name in ((self.train, ", ".join(self.names)), (self.held_out, held_out and held_out.label)):
            if examples is not None:
                fix = "set max_seq_len to at most that to truncate them (rows left without targets are skipped)"
                check_max_positions(engine.hf_config, [len(e.input_ids) for e in examples], f"examples in {name}", fix)
        return engine

    def train_step(self, step: int) -> dict[str, float]:
        engine = self.engine
        indices = self.data.local_batch(step, engine.dp_rank, engine.dp_size)
        stats = engine.train_batch(self.rows.pack(self.train, indices))
        stats["tokens_per_s"] = stats["tokens"] / max(stats["step_time_s"], 1e-9)
        return stats

    def postfix(self, stats: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{stats['loss']:.4f}", "tok_s": f"{stats['tokens_per_s']:.0f}"}

    def evaluate(self) -> dict[str, float]:
        assert self.held_out is not None
        engine, examples, size = self.engine, self.held_out, self.config.eval_batch_size
        loss_sum, weight_sum = 0.0, 0.0
        for start in range(0, len(examples), size):
            chunk = list(range(start, min(start + size, len(examples))))
            mine = chunk[engine.dp_rank :: engine.dp_size]
            batch = self.rows.pack(examples, mine or chunk[:1])
            if not mine:
                # A rank with no share still runs (collectives must match) with zero weight.
                batch.loss_mask.zero_()
            stats = engine.eval_batch(batch)
            loss_sum += stats["loss"] * stats["loss_weight"]
            weight_sum += stats["loss_weight"]
        return {"loss": loss_sum / max(weight_sum, 1e-12)}

    def export_extra(self, summary: dict[str, Any]) -> None:
        if self.engine.is_main and "hf_dir" in summary:
            self.rows.export(Path(summary["hf_dir"]))


def run_sft(config: SFTConfig) -> dict[str, Any]:
    """Train; return a summary (final train/eval loss, steps, output paths). Call on every rank."""
    return SFTTrainer(config).run()


TRAINER = TrainerSpec(config_cls=SFTConfig, run=run_sft, row_fields=SFT_ROW_FIELDS)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
