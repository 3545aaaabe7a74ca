"""Supervised fine-tuning: JSONL -> packed batches -> `TrainEngine`, with eval and metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shardforge.algorithms.data import SFT_ROW_FIELDS, GlobalBatchSampler, SFTExample, load_sft_examples, pack_examples
from shardforge.algorithms.data.config import apply_chat_template_override, eval_source, train_sources
from shardforge.algorithms.data.mixture import MixtureSampler
from shardforge.algorithms.data.sources import SourceConfig, is_plain_jsonl
from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.base import Trainer, TrainerConfig
from shardforge.algorithms.trainers.common import check_max_positions, with_total_steps

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


def _arg(source: SourceConfig) -> str | SourceConfig:
    """A plain local .jsonl path reads as before (errors as ``file:line``); anything else as a source."""
    return source.source if is_plain_jsonl(source) else source


def _check_lengths(examples: list[SFTExample], budget: int, name: str) -> None:
    longest = max(len(e.input_ids) for e in examples)
    if longest > budget:
        count = sum(len(e.input_ids) > budget for e in examples)
        raise ValueError(
            f"{count} example(s) in {name} are longer than engine.max_tokens_per_microbatch={budget} "
            f"(longest: {longest} tokens); raise engine.max_tokens_per_microbatch to >= {longest} or set "
            f"max_seq_len to truncate"
        )


class SFTTrainer(Trainer[SFTConfig]):
    """Next-token loss on the completion / assistant tokens."""

    name = "sft"

    def load_data(self) -> None:
        config = self.config
        apply_chat_template_override(self.tokenizer, config.data.chat_template)
        sources, held_out = train_sources(config), eval_source(config)
        per_source = [load_sft_examples(_arg(s), self.tokenizer, max_seq_len=config.max_seq_len) for s in sources]
        self.train = [e for examples in per_source for e in examples]
        self.sizes = [len(x) for x in per_source]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(per_source))]
        self.held_out = (
            load_sft_examples(_arg(held_out), self.tokenizer, max_seq_len=config.max_seq_len) if held_out else None
        )
        self.names = [s.label for s in sources]
        budget = config.engine.max_tokens_per_microbatch
        for examples, source in zip(per_source, sources):
            _check_lengths(examples, budget, source.label)
        if self.held_out is not None and held_out is not None:
            _check_lengths(self.held_out, budget, held_out.label)
        self.sampler: GlobalBatchSampler | MixtureSampler
        if config.data.mix:
            weights = [s.weight for s in sources]
            self.sampler = MixtureSampler(
                self.sizes, weights, config.global_batch_size, names=self.names, seed=config.seed
            )
        else:
            self.sampler = GlobalBatchSampler(len(self.train), config.global_batch_size, seed=config.seed)

    def build_engines(self) -> TrainEngine:
        config = self.config
        engine = TrainEngine(config.model, config.layout, with_total_steps(config.engine, config.steps))
        held_out = eval_source(config)
        for examples, name in ((self.train, ", ".join(self.names)), (self.held_out, held_out and held_out.label)):
            if examples is not None:
                fix = "set max_seq_len to at most that to truncate them (rows left without targets are skipped)"
                check_max_positions(engine.hf_config, [len(e.input_ids) for e in examples], f"examples in {name}", fix)
        return engine

    def data_state(self) -> dict[str, Any]:
        config = self.config
        state: dict[str, Any] = {
            "seed": config.seed,
            "global_batch_size": config.global_batch_size,
            "num_examples": len(self.train),
        }
        if isinstance(self.sampler, MixtureSampler):
            # Weights may change on resume (each source continues at its saved position); the sources may not.
            state["mixture_sources"] = dict(zip(self.names, self.sizes))
        return state

    def extra_state(self) -> dict[str, Any]:
        return {"mixture": self.sampler.state_dict()} if isinstance(self.sampler, MixtureSampler) else {}

    def setup(self, start: int, restored: dict[str, Any]) -> None:
        if isinstance(self.sampler, MixtureSampler) and "mixture" in restored:
            self.sampler.load_state_dict(restored["mixture"])

    def train_step(self, step: int) -> dict[str, float]:
        engine = self.engine
        if isinstance(self.sampler, MixtureSampler):
            pairs = self.sampler.local_batch(step, engine.dp_rank, engine.dp_size)
            indices = [self.offsets[source] + row for source, row in pairs]
        else:
            indices = self.sampler.local_batch(step, engine.dp_rank, engine.dp_size)
        stats = engine.train_batch(pack_examples(self.train, indices))
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
            batch = pack_examples(examples, mine or chunk[:1])
            if not mine:
                # A rank with no share still runs (collectives must match) with zero weight.
                batch.loss_mask.zero_()
            stats = engine.eval_batch(batch)
            loss_sum += stats["loss"] * stats["loss_weight"]
            weight_sum += stats["loss_weight"]
        return {"loss": loss_sum / max(weight_sum, 1e-12)}


def run_sft(config: SFTConfig) -> dict[str, Any]:
    """Train; return a summary (final train/eval loss, steps, output paths). Call on every rank."""
    return SFTTrainer(config).run()


TRAINER = TrainerSpec(config_cls=SFTConfig, run=run_sft, row_fields=SFT_ROW_FIELDS)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
