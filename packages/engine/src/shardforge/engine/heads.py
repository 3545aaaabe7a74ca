"""Model heads: what the engine builds on top of the decoder and what it returns per token.

A head is a strategy object (STYLE.md 15): the engine, the builder and the runners ask it for
the HF class, the TP plan and the per-token output, and never branch on ``config.head``.

- `LMHead` (``EngineConfig.head="lm"``): the causal LM; ``outputs`` are target-aligned log-probs
  (entry t = log p(token t | tokens before it), 0 at sequence starts) and, if asked, entropies of
  the distribution each target was drawn from, both at ``temperature``.
- `ValueHead` (``head="value"``): the HF ``AutoModelForTokenClassification`` of the family with
  ``num_labels=1`` (critics and reward models). Values are *per position*: entry t is the head's
  output after reading tokens 0..t (exactly ``model(input_ids).logits[..., 0]``). A reward
  model's score is the value at a sequence's last token; a critic's value of the state before
  target token t is entry t-1 (`shardforge.engine.batching.target_aligned_values`).
  Loading from a causal-LM checkpoint keeps the decoder and initialises the new head from
  ``EngineConfig.seed`` (N(0, initializer_range) weight, zero bias), so every layout starts from
  the same critic; classifier dropout is 0. Layouts: FSDP/HSDP, CP (values gathered over the CP
  group), TP (row-parallel head over the hidden dim, [T] output replicated); no pipeline stages.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.engine.batching import PackedBatch, pad_to_multiple, sequence_start_mask
from shardforge.engine.context import ParallelContext
from shardforge.engine.loading import is_model_dir, materialize_reference
from shardforge.tensor_parallel import vocab_parallel_entropy, vocab_parallel_logprobs
from shardforge.ulysses_cp import gather_sequence, packed_model_kwargs, slice_for_rank

__all__ = ["HEADS", "Head", "LMHead", "ValueHead", "make_head"]


def value_hf_config(hf_config: Any) -> Any:
    """A copy of an LM (or reward-model) config set up for a scalar value head."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    model_type = str(getattr(hf_config, "model_type", None))
    if model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        raise ValueError(
            f"model type {model_type!r} has no HF token-classification class, so it cannot carry a value head; "
            f"supported: {sorted(MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES)[:20]} ..."
        )
    config = copy.deepcopy(hf_config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.architectures = [MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES[model_type]]
    return config


def _init_head(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    score: nn.Linear = model.score
    std = float(getattr(model.config, "initializer_range", 0.02))
    with torch.no_grad():
        weight = torch.randn(score.weight.shape, generator=gen, dtype=torch.float32) * std
        score.weight.copy_(weight.to(score.weight.dtype))
        if score.bias is not None:
            score.bias.zero_()


def materialize_value_model(
    source: Any, hf_config: Any, *, dtype: torch.dtype, attn_implementation: str, seed: int
) -> Any:
    """The full value model on CPU (rank 0 only): decoder from ``source`` (an LM or a value-model
    directory) or from the config with ``seed``; a head missing from the checkpoint is initialised
    deterministically from ``seed``."""
    from transformers import AutoModelForTokenClassification

    if is_model_dir(source):
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the expected "lm_head unexpected / score missing" report is noise
        try:
            model, info = AutoModelForTokenClassification.from_pretrained(
                source, config=hf_config, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True
            )
        finally:
            hf_logging.set_verbosity(verbosity)
        decoder_missing = [k for k in info["missing_keys"] if not k.startswith("score.")]
        if decoder_missing:
            raise ValueError(
                f"{source!r} is missing decoder weights for a value model: {decoder_missing[:5]}; pass an HF causal-LM "
                "or token-classification model directory of the same family"
            )
        if any(k.startswith("score.") for k in info["missing_keys"]):
            _init_head(model, seed)
        return model
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    _init_head(model, seed)
    return model


def value_tp_plan(model: nn.Module, *, sequence_parallel: bool) -> dict[str, Any]:
    """The family's TP plan with the LM head replaced by a row-parallel value head.

    The head's weight is split over the hidden dim, its input (the final norm's output,
    sequence-sharded under SP) is redistributed to hidden shards, and the partial [.., 1]
    outputs are summed: every TP rank gets the values of the whole sequence.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from shardforge.tensor_parallel.plans import plan_for_model

    plan = dict(plan_for_model(model, sequence_parallel=sequence_parallel))
    plan.pop("lm_head", None)
    seq = Shard(1) if sequence_parallel else Replicate()
    plan["score"] = RowwiseParallel(input_layouts=seq, output_layouts=Replicate())
    return plan


def _padded(ctx: ParallelContext, mb: PackedBatch) -> PackedBatch:
    """``mb`` padded to the layout's token multiple, on the device."""
    return pad_to_multiple(mb, ctx.token_multiple).to(ctx.device)


def _model_inputs(
    ctx: ParallelContext, padded: PackedBatch, *extra: torch.Tensor
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The model's keyword arguments for this rank's CP chunk of ``padded`` (and the same chunk of
    ``extra`` per-token tensors)."""
    cp_group = ctx.cp_group
    tensors = [padded.input_ids, padded.position_ids, *extra]
    if cp_group is not None:
        tensors = [slice_for_rank(x, ctx.cp_rank, ctx.dims.cp) for x in tensors]
    kwargs = {
        "input_ids": tensors[0][None],
        "position_ids": tensors[1][None],
        "use_cache": False,
        **packed_model_kwargs(padded.cu_seqlens, cp_group=cp_group, prefixes=padded.prefixes),
    }
    return kwargs, tensors[2:]


class Head(ABC):
    """What the engine builds on the decoder, and its per-token output (see the module docstring)."""

    name: ClassVar[str]
    supports_pipeline: ClassVar[bool]
    """Whether the model can be split into pipeline stages with this head."""
    supports_lora: ClassVar[bool]
    """Whether LoRA adapters can train this head's model (a new head would stay frozen)."""
    has_token_distribution: ClassVar[bool]
    """Whether ``outputs`` can return entropies (loss functions that want them need this)."""
    has_full_distribution: ClassVar[bool] = False
    """Whether `distribution_outputs` returns each position's whole next-token distribution."""
    supports_prefix_sharing: ClassVar[bool] = False
    """Whether micro-batches may share prefixes (`engine.features.prefix_sharing`): text-only inputs."""

    temperature: float = 1.0
    """LM heads: log-probs and entropies are those of softmax(logits / T). RL trainers set T to the
    rollout temperature so ratios compare the distribution the samples came from."""

    @abstractmethod
    def hf_config(self, hf_config: Any) -> Any:
        """The HF config of the model this head builds (a copy when it changes anything)."""
        ...

    @abstractmethod
    def model_class(self) -> Any:
        """The HF auto class to build from a config (meta-device construction)."""
        ...

    @abstractmethod
    def materialize(self, source: Any, hf_config: Any, *, dtype: torch.dtype, attn: str, seed: int) -> Any:
        """The full model on CPU (rank 0): from ``source`` (a directory) or from the config with ``seed``."""
        ...

    def tp_plan(self, model: nn.Module, *, sequence_parallel: bool) -> dict[str, Any] | None:
        """The TP plan (None = the family's default plan)."""
        return None

    def adapt_to_layout(self, model: nn.Module, ctx: ParallelContext) -> None:
        """Called once on a distributed build, after the TP plan (if any) and before FSDP: e.g. a VLM's
        sequence chunking for SP / CP."""
        return None

    def keep_input_dtype_classes(self, model: nn.Module) -> tuple[str, ...]:
        """FSDP unit classes that keep their forward inputs' dtype under mixed precision (none by default;
        a VLM's vision blocks, see `engine.vision.VisionLMHead`)."""
        return ()

    @abstractmethod
    def outputs(
        self, model: nn.Module, ctx: ParallelContext, mb: PackedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T] per-token outputs of micro-batch ``mb`` (differentiable) and, if asked, [T] entropies."""
        ...

    def distribution_outputs(
        self, model: nn.Module, ctx: ParallelContext, mb: PackedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``outputs`` plus the [T, V] float32 log-probs of each target's whole distribution (one forward)."""
        raise ValueError(
            f"the {self.name!r} head has no full next-token distribution per position (full-vocabulary losses "
            "need a causal-LM head on a text model)"
        )


class LMHead(Head):
    """The causal LM: target-aligned log-probs (and entropies)."""

    name = "lm"
    supports_pipeline = True
    supports_lora = True
    has_token_distribution = True
    has_full_distribution = True
    supports_prefix_sharing = True

    def hf_config(self, hf_config: Any) -> Any:
        return hf_config

    def model_class(self) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def materialize(self, source: Any, hf_config: Any, *, dtype: torch.dtype, attn: str, seed: int) -> Any:
        return materialize_reference(source, hf_config, dtype=dtype, attn_implementation=attn, seed=seed)

    def next_token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(targets[t] | tokens <= t) at this head's temperature; vocab-parallel under TP."""
        if self.temperature != 1.0:  # the sampling distribution of RL rollouts
            logits = logits / self.temperature
        if isinstance(logits, DTensor):
            # Vocab-sharded logits (tensor parallel): never gathered to full vocab.
            return vocab_parallel_logprobs(logits, targets)
        return -F.cross_entropy(logits.float(), targets, reduction="none")

    def outputs(
        self, model: nn.Module, ctx: ParallelContext, mb: PackedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logprobs, entropies, _ = self._forward(model, ctx, mb, entropy=entropy, distribution=False)
        return logprobs, entropies

    def distribution_outputs(
        self, model: nn.Module, ctx: ParallelContext, mb: PackedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        logprobs, entropies, log_p = self._forward(model, ctx, mb, entropy=entropy, distribution=True)
        assert log_p is not None
        return logprobs, entropies, log_p

    def _forward(
        self, model: nn.Module, ctx: ParallelContext, mb: PackedBatch, *, entropy: bool, distribution: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        num_tokens = mb.num_tokens
        padded = _padded(ctx, mb)
        # Next-token targets come from the full sequence, before any CP slicing.
        kwargs, (targets,) = _model_inputs(ctx, padded, torch.roll(padded.input_ids, -1))
        logits = model(**kwargs).logits[0]
        next_logprobs = self.next_token_logprobs(logits, targets)
        starts = sequence_start_mask(padded.cu_seqlens, padded.num_tokens)
        cp_group = ctx.cp_group

        def realign(per_position: torch.Tensor) -> torch.Tensor:
            # Gather CP chunks back to the whole sequence (autograd: each rank keeps its chunk's grad).
            whole = gather_sequence(per_position, cp_group)
            # Position t predicted token t+1; re-align so entry (row) t belongs to token t.
            shifted = torch.cat([whole.new_zeros((1, *whole.shape[1:])), whole[:-1]])
            shifted = shifted.masked_fill(starts.view(-1, *([1] * (whole.dim() - 1))), 0.0)
            return shifted[:num_tokens]

        scaled = logits / self.temperature if self.temperature != 1.0 else logits
        entropies = log_p = None
        if distribution:
            if isinstance(scaled, DTensor):
                raise ValueError(
                    "full-vocabulary losses need each position's whole distribution on one rank, but tp > 1 shards "
                    "the vocabulary; use a layout with tp=1 (FSDP/HSDP/CP) or a per-token loss"
                )
            log_p = F.log_softmax(scaled.float(), dim=-1)
        if entropy:
            if isinstance(scaled, DTensor):
                entropies = vocab_parallel_entropy(scaled)
            else:
                lp = log_p if log_p is not None else F.log_softmax(scaled.float(), dim=-1)
                entropies = -(lp.exp() * lp).sum(-1)
            entropies = realign(entropies)
        return realign(next_logprobs), entropies, (realign(log_p) if log_p is not None else None)


class ValueHead(Head):
    """A scalar head on the decoder (critic / reward model): per-position values."""

    name = "value"
    supports_pipeline = False
    supports_lora = False
    has_token_distribution = False
    supports_prefix_sharing = True

    def hf_config(self, hf_config: Any) -> Any:
        return value_hf_config(hf_config)

    def model_class(self) -> Any:
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification

    def materialize(self, source: Any, hf_config: Any, *, dtype: torch.dtype, attn: str, seed: int) -> Any:
        return materialize_value_model(source, hf_config, dtype=dtype, attn_implementation=attn, seed=seed)

    def tp_plan(self, model: nn.Module, *, sequence_parallel: bool) -> dict[str, Any] | None:
        return value_tp_plan(model, sequence_parallel=sequence_parallel)

    def outputs(
        self, model: nn.Module, ctx: ParallelContext, mb: PackedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if entropy:
            raise ValueError("a value-head engine has no token distribution: its loss_fn cannot want entropy")
        kwargs, _ = _model_inputs(ctx, _padded(ctx, mb))
        values = model(**kwargs).logits[0, :, 0].float()
        return gather_sequence(values, ctx.cp_group)[: mb.num_tokens], None


HEADS: dict[str, type[Head]] = {"lm": LMHead, "value": ValueHead}
"""``EngineConfig.head`` name -> head class."""


def make_head(name: str) -> Head:
    """A fresh head object for ``EngineConfig.head``."""
    if name not in HEADS:
        raise ValueError(f"unknown engine head {name!r}; valid: {sorted(HEADS)}")
    return HEADS[name]()
