"""Value-head models for `TrainEngine` (``EngineConfig(head="value")``): critics and reward models.

The model is the HF ``AutoModelForTokenClassification`` of the family with ``num_labels=1``:
the decoder of the causal LM plus a linear ``score`` head on its final hidden states. Values
are *per position*: entry t is the head's output after reading tokens 0..t of its sequence
(exactly ``model(input_ids).logits[..., 0]`` of the HF model). A reward model's score is the
value at a sequence's last token (`last_token_scores`); a critic's value of the state before
target token t is entry t-1 (`target_aligned_values`).

Loading from a causal-LM checkpoint keeps the decoder weights and initialises the new head
deterministically from ``EngineConfig.seed`` (N(0, initializer_range) weight, zero bias), so
every layout starts from the same critic. Classifier dropout is set to 0 (values must be a
deterministic function of the weights for PPO and for parity across layouts).

Layouts: FSDP/HSDP, CP (values gathered over the CP group) and TP (the head is row-parallel
over the hidden dim, its [T] output replicated); pipeline parallelism is refused.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardforge.algorithms.batching import PackedBatch, check_cu_seqlens, pad_to_multiple
from shardforge.algorithms.modeling import is_model_dir

if TYPE_CHECKING:
    from shardforge.algorithms.engine import TrainEngine

__all__ = [
    "HEADS",
    "check_value_layout",
    "forward_values",
    "materialize_value_model",
    "model_class",
    "target_aligned_values",
    "value_hf_config",
    "value_tp_plan",
]

HEADS = ("lm", "value")
"""Valid ``EngineConfig.head`` values."""


def model_class(head: str) -> Any:
    """The HF auto class the engine builds for ``head``."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if head == "lm":
        return AutoModelForCausalLM
    if head == "value":
        return AutoModelForTokenClassification
    raise ValueError(f"unknown engine head {head!r}; valid: {list(HEADS)}")


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


def check_value_layout(pp: int) -> None:
    """Value-head models are not split into pipeline stages (yet)."""
    if pp > 1:
        raise ValueError(
            f"value-head models (EngineConfig.head='value') do not support pipeline parallelism (pp={pp}); "
            "use FSDP/HSDP, TP or CP layouts for the critic / reward model"
        )


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


def forward_values(engine: TrainEngine, mb: PackedBatch) -> torch.Tensor:
    """[T] per-position values of micro-batch ``mb`` (differentiable; gathered under CP)."""
    from shardforge.ulysses_cp import gather_sequence, packed_model_kwargs, slice_for_rank

    num_tokens = mb.num_tokens
    padded = pad_to_multiple(mb, engine._token_multiple).to(engine.device)
    input_ids, position_ids = padded.input_ids, padded.position_ids
    cp_group = engine._cp_group
    if cp_group is not None:
        assert engine.mesh is not None
        rank, cp = engine.mesh.local_rank("cp"), engine.dims.cp
        input_ids, position_ids = (slice_for_rank(x, rank, cp) for x in (input_ids, position_ids))
    out = engine.model(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        use_cache=False,
        **packed_model_kwargs(padded.cu_seqlens, cp_group=cp_group),
    )
    values = out.logits[0, :, 0].float()
    values = gather_sequence(values, cp_group)
    return values[:num_tokens]


def target_aligned_values(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] per-position values -> target-aligned: entry t is the value after tokens 0..t-1 (the
    state in which token t is chosen), 0 at sequence starts. Differentiable."""
    check_cu_seqlens(cu_seqlens, values.numel())
    shifted = torch.cat([values.new_zeros(1), values[:-1]])
    starts = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    begin = cu_seqlens[:-1].long()
    begin = begin[begin < values.numel()]
    starts[begin] = True
    return shifted.masked_fill(starts, 0.0)
