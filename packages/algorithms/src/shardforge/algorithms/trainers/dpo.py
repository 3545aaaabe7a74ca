"""Direct preference optimisation: `shardforge train dpo` (DPO, IPO, hinge, SimPO).

Rows (JSONL): ``{"prompt": ..., "chosen": ..., "rejected": ...}`` (the reward model's format, see
`shardforge.algorithms.data.preference`). A step packs this rank's pairs as consecutive (chosen,
rejected) sequences with only the response tokens as targets, runs the frozen reference model
forward (none for reference-free losses such as SimPO), and trains the policy on
`objectives.preference.preference_loss`, summed over pairs and divided by the global number of pairs
(the engine contract), so every layout and micro-batching gives the same update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from shardforge.algorithms.data import IS_CHOSEN, PAIR_ROW_FIELDS, PAIR_WEIGHT
from shardforge.algorithms.data.config import refuse_chat_template
from shardforge.algorithms.data.preference import PreferencePair, load_pair_data, pack_pairs
from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.base import Trainer
from shardforge.algorithms.trainers.pair_eval import pair_eval_loss
from shardforge.algorithms.trainers.run.common import (
    SourceSetState,
    build_reference,
    check_max_positions,
    with_total_steps,
)
from shardforge.algorithms.trainers.run.config import TrainerConfig
from shardforge.engine.batching import PackedBatch
from shardforge.engine.objectives import summarize_stats
from shardforge.engine.objectives.preference import (
    PreferenceLossConfig,
    check_preference_config,
    preference_loss,
    sequence_logprobs,
)
from shardforge.engine.objectives.stats import merge_stats

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    from shardforge.engine import TrainEngine

__all__ = ["REF_LOGPROBS", "DPOConfig", "DPOLossFn", "DPOTrainer", "run_dpo"]

REF_LOGPROBS = "ref_logprobs"
"""Per-token [T] extra: the reference model's target log-probs."""
_STAT_KEYS = (
    "num_pairs",
    "loss_sum",
    "loss_weight",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DPOConfig(TrainerConfig):
    """Everything `shardforge train dpo` needs (shared fields: `TrainerConfig`; names as TRL's DPOConfig)."""

    global_batch_size: int = 16
    """Pairs per optimizer step, across all data-parallel ranks."""
    max_seq_len: int | None = None
    """Truncate longer sequences, keeping the end (the response); None = keep."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo, hinge, simpo (reference-free), or a registered / ``package.module:name`` one."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward (TRL's default 0.1; SimPO's paper uses 2.0-2.5)."""
    label_smoothing: float = 0.0
    """Conservative DPO's label-flip probability (sigmoid and simpo), in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO's margin gamma (the loss subtracts gamma / beta), as TRL's CPOConfig."""
    reference_model: str | None = None
    """Frozen reference policy; None = ``model`` (its starting weights). Not built for reference-free losses."""
    offload_reference: bool = False
    """Keep the reference's weights in host memory except during its forward (an accelerator memory saver)."""
    eval_batch_size: int = 32
    """Pairs per eval batch."""

    reads_data_sources: ClassVar[bool] = True

    def __post_init__(self) -> None:
        TrainerConfig.__post_init__(self)
        refuse_chat_template(self, "dpo")
        check_preference_config(self.loss_config)
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size={self.global_batch_size} is invalid; it must be >= 1")

    @property
    def loss_config(self) -> PreferenceLossConfig:
        return PreferenceLossConfig(
            loss_type=self.loss_type, beta=self.beta, label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma
        )


class DPOLossFn:
    """`preference_loss` over the pairs of a micro-batch (log-prob engine output, response-token mask)."""

    def __init__(self, config: PreferenceLossConfig) -> None:
        self.config = config
        self.needs_reference = check_preference_config(config).needs_reference
        self._stats: list[dict[str, torch.Tensor]] = []

    def __call__(self, logprobs: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        if IS_CHOSEN not in mb.extras:
            return (logprobs * 0.0).sum()  # the engine's placeholder micro-batch
        chosen = mb.extras[IS_CHOSEN]
        if mb.num_sequences % 2 or not bool((chosen[0::2] == 1).all() and (chosen[1::2] == 0).all()):
            raise ValueError("a micro-batch must hold whole (chosen, rejected) pairs in that order (pack_pairs)")
        keep = mb.extras[PAIR_WEIGHT][0::2] > 0
        if not bool(keep.any()):
            return (logprobs * 0.0).sum()
        sums, counts = sequence_logprobs(logprobs, mb.loss_mask, mb.cu_seqlens)
        ref_c = ref_r = None
        if self.needs_reference:
            if REF_LOGPROBS not in mb.extras:
                raise ValueError(f"loss_type={self.config.loss_type!r} needs the {REF_LOGPROBS!r} extra")
            ref_sums, _ = sequence_logprobs(mb.extras[REF_LOGPROBS].to(logprobs.dtype), mb.loss_mask, mb.cu_seqlens)
            ref_c, ref_r = ref_sums[0::2][keep], ref_sums[1::2][keep]
        out = preference_loss(
            sums[0::2][keep], sums[1::2][keep], counts[0::2][keep], counts[1::2][keep], self.config, ref_c, ref_r
        )
        self._stats.append(out.stats)
        return out.loss_sum

    def loss_weight(self, mb: PackedBatch) -> torch.Tensor:
        if PAIR_WEIGHT not in mb.extras:
            return torch.zeros((), dtype=torch.float64)
        return (mb.extras[PAIR_WEIGHT][0::2] > 0).sum().double()

    def pop_stats(self, engine: TrainEngine) -> dict[str, float]:
        """Global per-pair means of this step's (or eval's) stats, then reset. Call on every rank."""
        merged = merge_stats(self._stats)
        self._stats = []
        for key in _STAT_KEYS:
            merged.setdefault(key, torch.zeros((), dtype=torch.float64))
        stats = summarize_stats(engine.reduce_loss_stats(merged), per="num_pairs")
        return {k: stats[k] for k in _STAT_KEYS[3:]} | {"num_pairs": stats["num_pairs"]}


def _check_pairs(pairs: list[PreferencePair], budget: int, name: str) -> None:
    longest = max(len(p.chosen) + len(p.rejected) for p in pairs)
    if longest > budget:
        raise ValueError(
            f"a pair of {name} has {longest} tokens (chosen + rejected, kept in one micro-batch) but "
            f"engine.max_tokens_per_microbatch={budget}; raise the budget to >= {longest} or set max_seq_len"
        )
    for number, pair in enumerate(pairs, 1):
        if len(pair.chosen) <= max(pair.chosen_prompt_len, 1) or len(pair.rejected) <= max(pair.rejected_prompt_len, 1):
            raise ValueError(
                f"{name}: pair {number} has an empty chosen or rejected response (after truncation to "
                "max_seq_len); DPO needs response tokens on both sides: fix the row or raise max_seq_len"
            )


class DPOTrainer(SourceSetState, Trainer[DPOConfig]):
    """Policy trained on preference pairs against a frozen reference (or none, for SimPO)."""

    name = "dpo"

    def load_data(self) -> None:
        config = self.config
        self.data, self.held_out, self.held_label = load_pair_data(config, self.tokenizer, config.global_batch_size)
        self.train = self.data.items
        budget = config.engine.max_tokens_per_microbatch
        for pairs, name in zip(self.data.per_source, self.data.names):
            _check_pairs(pairs, budget, name)
        if self.held_out is not None:
            _check_pairs(self.held_out, budget, str(self.held_label))
        self.loss_fn = DPOLossFn(config.loss_config)

    def build_engines(self) -> TrainEngine:
        config = self.config
        from shardforge.engine import TrainEngine

        engine = TrainEngine(config.model, config.layout, with_total_steps(config.engine, config.steps))
        if config.global_batch_size < engine.dp_size:
            raise ValueError(
                f"global_batch_size={config.global_batch_size} pairs < data-parallel size {engine.dp_size}"
            )
        for pairs, name in ((self.train, self.data.label), (self.held_out, self.held_label)):
            if pairs is not None:
                lengths = [max(len(p.chosen), len(p.rejected)) for p in pairs]
                check_max_positions(
                    engine.hf_config, lengths, f"sequences in {name}", "set max_seq_len to at most that"
                )
        self.reference = build_reference(config, self.loss_fn.needs_reference)
        return engine

    def _batch(self, pairs: list[PreferencePair], indices: list[int], weight: float = 1.0) -> PackedBatch:
        batch = pack_pairs(pairs, indices, weight=weight, responses_only=True)
        if self.reference is not None:
            batch.extras[REF_LOGPROBS] = self.reference.forward(batch)
        return batch

    def train_step(self, step: int) -> dict[str, float]:
        engine, loss_fn = self.engine, self.loss_fn
        indices = self.data.local_batch(step, engine.dp_rank, engine.dp_size)
        stats = engine.train_batch(self._batch(self.train, indices), loss_fn, loss_fn.loss_weight)
        stats |= loss_fn.pop_stats(engine)
        stats["tokens_per_s"] = stats["tokens"] / max(stats["step_time_s"], 1e-9)
        return stats

    def step_summary(self, stats: dict[str, float]) -> dict[str, Any]:
        return {"train_loss": stats["loss"], "train_accuracy": stats["rewards/accuracies"]}

    def postfix(self, stats: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{stats['loss']:.4f}", "acc": f"{stats['rewards/accuracies']:.3f}"}

    def evaluate(self) -> dict[str, float]:
        assert self.held_out is not None
        engine, pairs = self.engine, self.held_out
        loss_fn = DPOLossFn(self.config.loss_config)
        loss = pair_eval_loss(
            engine, len(pairs), self.config.eval_batch_size, loss_fn,
            lambda indices, weight: self._batch(pairs, indices, weight=weight),
        )  # fmt: skip
        return {"loss": loss, **loss_fn.pop_stats(engine)}


def run_dpo(config: DPOConfig) -> dict[str, Any]:
    """Train a policy on preference pairs; return a summary. Call on every rank."""
    return DPOTrainer(config).run()


TRAINER = TrainerSpec(config_cls=DPOConfig, run=run_dpo, row_fields=PAIR_ROW_FIELDS)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
