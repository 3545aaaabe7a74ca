"""Reward-model training: preference pairs -> Bradley-Terry loss on a value-head `TrainEngine`.

Rows (JSONL): ``{"prompt": ..., "chosen": ..., "rejected": ...}`` (see `shardforge.algorithms.data.preference`).
Each pair's value-head scores at the last token enter ``-log sigmoid(s_chosen - s_rejected)``, summed
over pairs and normalised by the global number of pairs (the engine contract), so any
micro-batching or data-parallel split gives the same update.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from shardforge.algorithms.data import IS_CHOSEN, PAIR_ROW_FIELDS, PAIR_WEIGHT, PreferencePair, pack_pairs
from shardforge.algorithms.data.config import refuse_chat_template
from shardforge.algorithms.data.preference import load_pair_data
from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.base import Trainer
from shardforge.algorithms.trainers.pair_eval import pair_eval_loss
from shardforge.algorithms.trainers.rl.ppo_update import dp_reduce_stats
from shardforge.algorithms.trainers.run.common import SourceSetState, with_total_steps
from shardforge.algorithms.trainers.run.config import TrainerConfig
from shardforge.engine.batching import PackedBatch
from shardforge.engine.objectives import bradley_terry_loss, last_token_scores, summarize_stats
from shardforge.engine.objectives.stats import merge_stats

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    from shardforge.engine import TrainEngine

__all__ = ["BradleyTerryLossFn", "RMConfig", "RMTrainer", "evaluate_pairs", "run_rm"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RMConfig(TrainerConfig):
    """Everything `shardforge train rm` needs (shared fields: `TrainerConfig`; the engine's head is
    forced to "value", and ``model`` may be a causal LM (new value head) or a reward model)."""

    global_batch_size: int = 16
    """Pairs per optimizer step, across all data-parallel ranks."""
    max_seq_len: int | None = None
    """Truncate longer sequences (keeping the end, where the score is read); None = keep."""
    margin: float | None = None
    """Optional constant margin in the loss: -log sigmoid(s_c - s_r - margin)."""
    eval_batch_size: int = 32
    """Pairs per eval batch."""

    reads_data_sources: ClassVar[bool] = True

    def __post_init__(self) -> None:
        TrainerConfig.__post_init__(self)
        refuse_chat_template(self, "rm")


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


class RMTrainer(SourceSetState, Trainer[RMConfig]):
    """Bradley-Terry reward model on preference pairs."""

    name = "rm"

    def load_data(self) -> None:
        config = self.config
        self.data, self.held_out, held_label = load_pair_data(config, self.tokenizer, config.global_batch_size)
        self.train = self.data.items
        budget = config.engine.max_tokens_per_microbatch
        for pairs, name in zip(self.data.per_source, self.data.names):
            _check_lengths(pairs, budget, name)
        if self.held_out is not None:
            _check_lengths(self.held_out, budget, str(held_label))
        self.loss_fn = BradleyTerryLossFn(config.margin)

    def build_engines(self) -> TrainEngine:
        config = self.config
        engine_config = with_total_steps(dataclasses.replace(config.engine, head="value"), config.steps)
        from shardforge.engine import TrainEngine

        engine = TrainEngine(config.model, config.layout, engine_config)
        if config.global_batch_size < engine.dp_size:
            raise ValueError(
                f"global_batch_size={config.global_batch_size} pairs < data-parallel size {engine.dp_size}"
            )
        return engine

    def train_step(self, step: int) -> dict[str, float]:
        engine, loss_fn = self.engine, self.loss_fn
        indices = self.data.local_batch(step, engine.dp_rank, engine.dp_size)
        stats = engine.train_batch(pack_pairs(self.train, indices), loss_fn, loss_fn.loss_weight)
        stats |= _pair_stats(loss_fn, engine)
        stats["tokens_per_s"] = stats["tokens"] / max(stats["step_time_s"], 1e-9)
        return stats

    def step_summary(self, stats: dict[str, float]) -> dict[str, Any]:
        return {"train_loss": stats["loss"], "train_accuracy": stats["accuracy"]}

    def postfix(self, stats: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{stats['loss']:.4f}", "acc": f"{stats['accuracy']:.3f}"}

    def evaluate(self) -> dict[str, float]:
        assert self.held_out is not None
        return evaluate_pairs(self.engine, self.held_out, self.config.eval_batch_size, self.config.margin)


def run_rm(config: RMConfig) -> dict[str, Any]:
    """Train a reward model; return a summary (loss/accuracy, paths). Call on every rank."""
    return RMTrainer(config).run()


def evaluate_pairs(
    engine: TrainEngine, pairs: list[PreferencePair], batch_size: int, margin: float | None = None
) -> dict[str, float]:
    """Global Bradley-Terry loss and accuracy on ``pairs`` (split across data-parallel ranks)."""
    loss_fn = BradleyTerryLossFn(margin)
    loss = pair_eval_loss(
        engine, len(pairs), batch_size, loss_fn, lambda indices, weight: pack_pairs(pairs, indices, weight=weight)
    )
    return {"loss": loss, **_pair_stats(loss_fn, engine)}


TRAINER = TrainerSpec(config_cls=RMConfig, run=run_rm, row_fields=PAIR_ROW_FIELDS)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
