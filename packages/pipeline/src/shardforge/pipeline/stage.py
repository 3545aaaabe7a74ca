"""Cut an HF decoder-only causal LM into pipeline stages that keep the global parameter names.

A `DecoderStage` holds the model's own submodules under their original attribute paths
(``model.embed_tokens``, ``model.layers.<global index>``, ``model.norm``, ``lm_head``), so
``state_dict`` keys, DCP checkpoints and HF export see the same names as the unsplit model;
modules a stage does not own are None (as torchtitan does). The layer list becomes a
`ModuleDict` keyed by the global layer index. Every stage references the rotary
embedding module (buffers only), since every layer needs the position embeddings.

Legend: L = tokens of one (padded) micro-batch, H = hidden size, V = vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["DecoderStage", "LayerKwargsFn", "OutputFn", "merge_stages", "split_decoder"]

LayerKwargsFn = Callable[[dict[str, Any]], dict[str, Any]]
"""Micro-batch kwargs (e.g. ``cu_seqlens``) -> extra kwargs of every decoder layer (e.g. attention kwargs)."""
OutputFn = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
"""(logits [1, L, V], micro-batch kwargs) -> what the last stage returns (e.g. per-token log-probs)."""


class DecoderStage(nn.Module):
    """One pipeline stage of an HF decoder: ``forward(x, position_ids, **kwargs)``.

    ``x`` is ``input_ids`` [1, L] on the first stage and hidden states [1, L, H] elsewhere.
    Middle stages return hidden states; the last stage returns ``output_fn(logits, kwargs)``
    (logits [1, L, V] when no ``output_fn`` is given).
    """

    def __init__(
        self,
        causal_lm: nn.Module,
        layer_ids: Sequence[int],
        *,
        stage_index: int,
        num_stages: int,
        layer_kwargs_fn: LayerKwargsFn | None = None,
        output_fn: OutputFn | None = None,
    ) -> None:
        super().__init__()
        prefix = getattr(causal_lm, "base_model_prefix", "model") or "model"
        decoder = getattr(causal_lm, prefix, None)
        layers = getattr(decoder, "layers", None)
        if decoder is None or not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
            raise TypeError(
                f"{type(causal_lm).__name__} is not a supported decoder: expected `{prefix}.layers` (a ModuleList "
                "of decoder layers), `embed_tokens`, `norm`, `rotary_emb` and `lm_head` (Llama/Qwen2/Qwen3/"
                "Qwen3-MoE/Mistral layout)"
            )
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.layer_ids = list(layer_ids)
        self.config = getattr(causal_lm, "config", None)
        # FSDP / activation-checkpointing wrap policies read the decoder-layer class names here.
        self._no_split_modules = list(getattr(causal_lm, "_no_split_modules", None) or [])
        self.prefix = prefix
        self.layer_kwargs_fn = layer_kwargs_fn
        self.output_fn = output_fn
        owned = nn.ModuleDict({str(i): _index(layers, i) for i in self.layer_ids})
        parts: Any = nn.Module()
        parts.embed_tokens = decoder.embed_tokens if self.is_first else None
        parts.layers = owned
        parts.norm = decoder.norm if self.is_last else None
        # Every stage needs the position embeddings; the rotary module has (non-persistent) buffers
        # only, so stages share it rather than own it.
        parts.rotary_emb = decoder.rotary_emb
        self.add_module(prefix, parts)
        self.lm_head: Any = causal_lm.lm_head if self.is_last else None

    @property
    def decoder(self) -> Any:
        """The container of ``embed_tokens`` / ``layers`` / ``norm`` / ``rotary_emb`` (None where not owned)."""
        return getattr(self, self.prefix)

    def get_input_embeddings(self) -> nn.Module | None:
        return self.decoder.embed_tokens  # type: ignore[no-any-return]

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        decoder = self.decoder
        hidden = decoder.embed_tokens(x) if decoder.embed_tokens is not None else x
        layer_kwargs = self.layer_kwargs_fn(kwargs) if self.layer_kwargs_fn is not None else kwargs
        position_embeddings = decoder.rotary_emb(hidden, position_ids)
        for layer in decoder.layers.values():
            out = layer(hidden, position_embeddings=position_embeddings, position_ids=position_ids, **layer_kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        if decoder.norm is not None:
            hidden = decoder.norm(hidden)
        if self.lm_head is None:
            return hidden  # type: ignore[no-any-return]
        logits = self.lm_head(hidden)
        return self.output_fn(logits, kwargs) if self.output_fn is not None else logits  # type: ignore[no-any-return]


def _index(layers: nn.ModuleList | nn.ModuleDict, i: int) -> nn.Module:
    return layers[str(i)] if isinstance(layers, nn.ModuleDict) else layers[i]


def split_decoder(
    causal_lm: nn.Module,
    stage_layers: Sequence[range],
    stage_ids: Sequence[int],
    *,
    layer_kwargs_fn: LayerKwargsFn | None = None,
    output_fn: OutputFn | None = None,
) -> list[DecoderStage]:
    """The `DecoderStage` modules ``stage_ids`` of ``causal_lm`` split as ``stage_layers``.

    The stages share (do not copy) the model's parameters; build the model on the meta
    device to never hold the whole model on one rank. Tied input/output embeddings cannot
    live on two stages, so they are refused when stage 0 and the last stage differ.
    """
    num_stages = len(stage_layers)
    num_layers = int(getattr(getattr(causal_lm, "config", None), "num_hidden_layers", 0) or 0)
    covered = [i for r in stage_layers for i in r]
    if num_layers and covered != list(range(num_layers)):
        raise ValueError(f"stage_layers {stage_layers} must cover layers 0..{num_layers - 1} in order exactly once")
    bad = [s for s in stage_ids if not 0 <= s < num_stages]
    if bad:
        raise ValueError(f"stage ids {bad} out of range for {num_stages} stages")
    get_in = getattr(causal_lm, "get_input_embeddings", None)
    get_out = getattr(causal_lm, "get_output_embeddings", None)
    if num_stages > 1 and get_in is not None and get_out is not None:
        emb, head = get_in(), get_out()
        if emb is not None and head is not None and emb.weight is head.weight:
            raise ValueError(
                "the input embedding and lm_head share one weight (tie_word_embeddings=True), but pipeline "
                "parallelism puts them on different stages; untie them (config.tie_word_embeddings=False and "
                "a copy of the weight) or use pp=1"
            )
    return [
        DecoderStage(
            causal_lm,
            stage_layers[s],
            stage_index=s,
            num_stages=num_stages,
            layer_kwargs_fn=layer_kwargs_fn,
            output_fn=output_fn,
        )
        for s in stage_ids
    ]


class _MergedStages(nn.Module):
    """All stages of one rank as one module with global names (for optimizers and checkpoints)."""

    def __init__(self, stages: Sequence[DecoderStage]) -> None:
        super().__init__()
        prefix = stages[0].prefix
        parts: Any = nn.Module()
        parts.layers = nn.ModuleDict()
        lm_head: nn.Module | None = None
        for stage in stages:
            decoder = stage.decoder
            if decoder.embed_tokens is not None:
                parts.embed_tokens = decoder.embed_tokens
            if decoder.norm is not None:
                parts.norm = decoder.norm
            for key, layer in decoder.layers.items():
                parts.layers[key] = layer
            if stage.lm_head is not None:
                lm_head = stage.lm_head
        parts.rotary_emb = stages[0].decoder.rotary_emb
        self.add_module(prefix, parts)
        if lm_head is not None:
            self.lm_head = lm_head
        self.stages = list(stages)  # plain list: not registered, names stay global
        self.config = stages[0].config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the merged view of pipeline stages is for parameters and state dicts; run the pipeline")

    def named_stage_modules(self) -> Iterator[tuple[int, DecoderStage]]:
        for stage in self.stages:
            yield stage.stage_index, stage


def merge_stages(stages: Sequence[DecoderStage]) -> nn.Module:
    """One module over this rank's stages whose parameter names are the global HF names.

    With one stage per rank the stage itself is returned. With several (virtual stages) a
    view module shares their submodules, so ``parameters()`` / ``state_dict()`` cover all of
    them once (use it for the optimizer, grad clipping, DCP and HF export).
    """
    if not stages:
        raise ValueError("merge_stages needs at least one stage")
    if len(stages) == 1:
        return stages[0]
    return _MergedStages(stages)
