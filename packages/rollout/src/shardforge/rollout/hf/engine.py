"""The embedded rollout engine: HF ``generate`` on a local copy of the policy.

It runs inside each trainer process (or any side process): it loads the initial HF model
directory, samples responses with their behaviour log-probs, and refreshes its weights from
versions that the trainer publishes with weight-sync (`DiskTransport` -> `DiskWeightSource`
-> `WeightReceiver`: verified, all-or-nothing, monotonic versions).

Vision-language models (the config has a ``vision_config``: Qwen2.5-VL, Qwen3-VL) load with
``AutoModelForImageTextToText`` and generate from image prompts: ``generate(prompts, params,
images=[ImageInputs | None per prompt])``; the prompt ids hold the expanded image tokens
(`data.vlm.encode_vlm_prompt`).
Multi-turn episodes (``generate(..., sessions=...)``, which the workflows' request queue passes) and
partial-rollout chunks keep their KV cache between calls and prefill only the new tokens
(`rollout.kv_reuse`; ``kv_reuse=False`` re-encodes the whole context every call).
Colocated with a trainer (``rollout.sleep``), `sleep` frees the weights and KV caches between generation
phases; the next version the engine receives brings them back (`WeightReceiver.release`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
from collections.abc import Hashable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shardforge.mesh import parse_dtype
from shardforge.rollout.chunked import ChunkedGeneration, generate_in_chunks
from shardforge.rollout.hf.extras import routed_per_row, visual_kwargs
from shardforge.rollout.hf.kv_reuse import (
    KVReuseCache,
    batch_layout,
    cache_supports_reuse,
    past_from_sessions,
    session_from_cache,
    weights_key,
)
from shardforge.rollout.hf.shared_prefill import shared_prefill
from shardforge.rollout.types import ImageInputs, Rollout, SamplingParams
from shardforge.weight_sync import DiskWeightSource, WeightReceiver, WeightVersionError

__all__ = ["HFRolloutEngine"]

logger = logging.getLogger(__name__)


class HFRolloutEngine:
    """Sample with ``transformers`` ``generate``; weights follow a weight-sync disk root.

    ``accepts_images``: `generate` takes ``images=`` (`rollout.types.generate_rollouts`).

    Args:
        model_dir: HF model directory with the initial weights (version 0).
        tokenizer: the tokenizer (pad/eos ids and decoding).
        weights_root: where the trainer publishes versions (`DiskTransport` root); None = never
            refreshed.
        dtype: dtype of the rollout model ("float32", "bf16", ...).
        batch_size: rows per ``generate`` call (prompts x samples are chunked).
        kv_reuse: keep each session's KV cache between calls and prefill only the tokens its next prompt adds
            (equal to re-encoding up to float reduction order; dropped on any weight change). False: re-encode.
        kv_reuse_max_tokens: cap on the tokens cached over all sessions (the oldest sessions are evicted).
        share_prefill: encode each distinct prompt of a call once, not once per sample (`hf.shared_prefill`).
        record_routing: record each token's top-k experts per MoE layer into `Rollout.routed_experts` (router
            replay; MoE models).
        chunks: partial rollouts: generate ``chunks.chunk_tokens`` new tokens at a time and call
            ``chunks.between_chunks()`` after each (`chunked.ChunkedGeneration`); None: one ``generate`` per batch.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        tokenizer: Any,
        *,
        weights_root: str | os.PathLike[str] | None = None,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        batch_size: int = 256,
        kv_reuse: bool = True,
        kv_reuse_max_tokens: int = 65536,
        share_prefill: bool = True,
        record_routing: bool = False,
        chunks: ChunkedGeneration | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"rollout model directory {str(model_dir)!r} does not exist")
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        vision = getattr(AutoConfig.from_pretrained(str(model_dir)), "vision_config", None) is not None
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(str(model_dir), dtype=parse_dtype(dtype))
        self.model = model.to(self.device)  # type: ignore[arg-type]
        self.model.eval()
        self.model.config.use_cache = True
        self.image_token_id: int | None = getattr(self.model.config, "image_token_id", None) if vision else None
        """The image token of a vision-language model (None: a text model, no image prompts)."""
        # A VLM never samples its image/video placeholder tokens: the trainer's forward would take a generated
        # one for an image without pixels. Behaviour log-probs stay those of the full softmax (raw logits), as the
        # trainer computes them; the suppressed mass is what an (almost never) sampled placeholder would have had.
        placeholders = (getattr(self.model.config, k, None) for k in ("image_token_id", "video_token_id"))
        self.suppress_tokens = [t for t in placeholders if isinstance(t, int)] if vision else []
        self.receiver = WeightReceiver(self.model)
        self.replay: Any = None
        """A `shardforge.moe_ep.RouterReplay` when routing is recorded (``record_routing``)."""
        if record_routing:
            from shardforge.moe_ep import RouterReplay

            self.replay = RouterReplay(self.model)
        self.source = DiskWeightSource(weights_root) if weights_root is not None else None
        self.batch_size = batch_size
        self.chunks = chunks
        """Partial rollouts: generate in chunks, calling ``chunks.between_chunks()`` after each (None: one
        ``generate`` call per batch). It may switch the weights (`update_weights`); the rest of every unfinished
        response is then generated, and its log-probs taken, under the new ones."""
        self.kv_reuse = kv_reuse
        """Reuse sessions' KV caches across calls (multi-turn episodes, partial-rollout chunks)."""
        self.kv_cache = KVReuseCache(kv_reuse_max_tokens)
        """The sessions' KV caches (``kv_cache.stats``: hits, misses, reused tokens, evictions, invalidations)."""
        self._kv_unsupported = False
        self.share_prefill = share_prefill
        """Encode each distinct prompt of a call once, not once per sample (`hf.shared_prefill`)."""
        self._chunk_calls = itertools.count()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token; generation needs one to pad prompts")

    accepts_images = True

    @property
    def version(self) -> int:
        return self.receiver.version

    def update_weights(self, version: int | None = None) -> int:
        """Apply ``version`` (None = newest committed) if it is newer than the serving one."""
        if self.source is None:
            raise RuntimeError("this rollout engine has no weights_root to update from")
        target = self.source.latest() if version is None else version
        if target is None:
            raise WeightVersionError(f"no committed weight version under {self.source.root}")
        if target != self.receiver.version:
            manifest = self.source.manifest(target)
            self.receiver.apply(manifest, self.source.tensors(manifest))
            # Drop the stale KV now (to free it); other weight changes are caught by the next call's check.
            self.kv_cache.check_weights(weights_key(self.version, self.model))
        return self.receiver.version

    @property
    def asleep(self) -> bool:
        """Whether `sleep` freed the weights and no version arrived since (`generate` refuses to run)."""
        return self.receiver.released

    def sleep(self) -> int:
        """Free the weights and every session's KV cache until the next version arrives (`update_weights`, or
        a publish straight into `receiver`), which must be newer than the serving one; return the weight
        bytes freed. verl's ``free_cache_engine`` / vLLM's level-2 sleep: the trainer gets the memory back."""
        self.kv_cache.invalidate()
        freed = self.receiver.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        """Drop the cached KV of ``sessions`` (their episodes ended)."""
        self.kv_cache.end(sessions)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        images: Sequence[ImageInputs | None] | None = None,
        sessions: Sequence[Hashable | None] | None = None,
    ) -> list[Rollout]:
        """``len(prompts) * params.n`` rollouts, prompt by prompt (each prompt's samples together).

        Sample ``j`` of prompt ``i`` draws from its own generator, seeded ``seeds[i] + j`` (`rollout.seeds`):
        what it samples does not depend on the other rows of the batch, on ``batch_size``, on chunking or on
        whether its session's KV cache was reused.

        ``images``: per prompt, its images (None: none); a vision-language model only.
        ``sessions`` (``params.n`` = 1): one key per prompt (None: none). A session's KV cache is kept after
        the call; when its next prompt extends ``prompt + response[:-1]`` only the new tokens are prefilled.
        `end_sessions` drops it; so do a weight change, a prompt that does not extend it, and the cap.
        (Vision-language models re-encode every call: their mRoPE positions depend on the whole prompt.)
        """
        if len(prompts) == 0:
            raise ValueError("generate() needs at least one prompt")
        if self.asleep:
            raise RuntimeError(
                f"the rollout engine sleeps (rollout.sleep): its weights were freed after generating with version "
                f"{self.version} and come back with the next published version; publish before generating"
            )
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
        row_images: list[ImageInputs | None] | None = None
        if images is not None and any(i is not None for i in images):
            self._check_images(prompts, images)
            row_images = [images[i] for i in range(len(prompts)) for _ in range(params.n)]
        if sessions is not None and (len(sessions) != len(prompts) or params.n != 1):
            raise ValueError(
                f"sessions: one key per prompt with n=1; got {len(sessions)} keys for {len(prompts)} prompts, "
                f"n={params.n}"
            )
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        keys: list[Hashable | None] = list(sessions) if sessions is not None else [None] * len(rows)
        from shardforge.rollout.hf.row_sampler import row_uniforms  # subclasses a transformers class

        uniforms = None if params.temperature == 0 else row_uniforms(params, len(prompts))
        out: list[Rollout] = []
        for start in range(0, len(rows), self.batch_size):
            batch, batch_keys = rows[start : start + self.batch_size], keys[start : start + self.batch_size]
            draws = None if uniforms is None else uniforms[start : start + self.batch_size]
            if self.chunks is not None:
                out += self._generate_interruptible(batch, params, batch_keys, draws)
            else:
                visual = row_images[start : start + self.batch_size] if row_images is not None else None
                out += self._generate_chunk(batch, params, batch_keys, draws, visual)
        return out

    def _check_images(self, prompts: Sequence[Sequence[int]], images: Sequence[ImageInputs | None]) -> None:
        if self.image_token_id is None:
            raise ValueError("image prompts need a vision-language model (its config has a vision_config)")
        if self.chunks is not None:
            raise ValueError("partial rollouts (interrupted generation) do not take image prompts yet")
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} image entries (one per prompt)")
        merge = int(self.model.config.vision_config.spatial_merge_size)
        for i, (prompt, inputs) in enumerate(zip(prompts, images, strict=True)):
            tokens = sum(1 for t in prompt if t == self.image_token_id)
            expected = int(inputs.image_grid_thw.prod(-1).sum()) // merge**2 if inputs is not None else 0
            if tokens != expected:
                raise ValueError(f"prompt {i} has {tokens} image tokens but its images fill {expected}")

    def _generate_interruptible(
        self,
        rows: list[tuple[int, list[int]]],
        params: SamplingParams,
        keys: list[Hashable | None],
        uniforms: torch.Tensor | None,
    ) -> list[Rollout]:
        """Partial rollouts: ``chunks.chunk_tokens`` new tokens at a time; between chunks ``chunks.between_chunks``
        may load newer weights, and unfinished rows continue from their prompt + generated ids (the
        context is recomputed under the new weights, as AReaL's interruptible generation does). Rows that
        finished leave the batch. Every token keeps the version and behaviour log-prob that produced it. Rows
        without a session key get one for this call: a chunk prefills only the new tokens unless the weights
        changed."""
        assert self.chunks is not None and self.replay is None
        call = next(self._chunk_calls)
        own = [("chunks", call, i) for i, key in enumerate(keys) if key is None]
        keys = [("chunks", call, i) if key is None else key for i, key in enumerate(keys)]

        def chunk(active: list[int], context: list[tuple[int, list[int]]], budget: int, done: int) -> list[Rollout]:
            # Each unfinished row continues at the same position of its own stream of uniforms.
            draws = None if uniforms is None else uniforms[active, done : done + budget]
            params_ = dataclasses.replace(params, max_new_tokens=budget)
            return self._generate_chunk(context, params_, [keys[i] for i in active], draws)

        decode = partial(self.tokenizer.decode, skip_special_tokens=True)
        try:
            return generate_in_chunks(
                rows, params.max_new_tokens, self.chunks.chunk_tokens, chunk, self.chunks.between_chunks, decode
            )
        finally:
            self.end_sessions(own)

    def _generate_chunk(
        self,
        rows: list[tuple[int, list[int]]],
        params: SamplingParams,
        keys: list[Hashable | None],
        uniforms: torch.Tensor | None,
        images: list[ImageInputs | None] | None = None,
    ) -> list[Rollout]:
        # Router replay records the routing of the whole prompt, which a cached prefix would skip; a VLM's
        # mRoPE positions (and its image features) are computed from the whole prompt in one pass.
        reuse = (
            self.kv_reuse
            and self.replay is None
            and self.image_token_id is None
            and not self._kv_unsupported
            and any(k is not None for k in keys)
        )
        if reuse:
            self.kv_cache.check_weights(weights_key(self.version, self.model))
        entries = [self.kv_cache.take(k, ids) if reuse and k is not None else None for k, (_, ids) in zip(keys, rows)]
        cached = [len(e.ids) if e is not None else 0 for e in entries]
        # Left padding (every prompt ends at the same column); with sessions, their cached ids in front.
        input_ids, attention, width_cached = batch_layout([ids for _, ids in rows], cached, self.pad_id)
        past = past_from_sessions(entries, width_cached) if width_cached else None
        # GRPO groups; not for a VLM (its mRoPE positions come from the whole prompt, as for kv_reuse)
        if past is None and self.share_prefill and self.replay is None and self.image_token_id is None:
            past = shared_prefill(
                self.model, input_ids.to(self.device), attention.to(self.device), [tuple(r) for _, r in rows]
            )
        del entries
        width = input_ids.shape[1]
        greedy = uniforms is None
        # Sampling is the logits processor's (one uniform per row and token); `generate` then takes its argmax.
        # `width` counts the cached columns too: the processor's step index is independent of reuse.
        # Imported here: the launching `shardforge` process imports this module and needs no transformers.
        from transformers import LogitsProcessorList

        from shardforge.rollout.hf.row_sampler import RowSampler

        sampler = [] if uniforms is None else [RowSampler(uniforms.to(self.device), width, params)]
        extra: dict[str, Any] = {"logits_processor": LogitsProcessorList(sampler)}
        recording = self.replay.record() if self.replay is not None else contextlib.nullcontext(None)
        if self.suppress_tokens:
            extra["suppress_tokens"] = self.suppress_tokens
        if images is not None and any(i is not None for i in images):  # row order: generate fills image tokens so
            assert self.image_token_id is not None  # _check_images refused image prompts for a text model
            extra |= visual_kwargs(input_ids, images, self.image_token_id, self.device)
        with recording as routed:
            result = self._run_generate(input_ids, attention, params, extra, past)
        new_tokens_dev = result.sequences[:, width:]
        routing = routed_per_row(routed, rows, width, new_tokens_dev.shape[1]) if routed is not None else None
        rollouts = self._rollouts(rows, result, new_tokens_dev, greedy, params, routing)
        if reuse:
            self._keep_sessions(keys, rollouts, result.past_key_values, cached, width_cached, width)
        return rollouts

    def _keep_sessions(
        self,
        keys: list[Hashable | None],
        rollouts: list[Rollout],
        cache: Any,
        cached: list[int],
        width_cached: int,
        width: int,
    ) -> None:
        """Cache each keyed row's KV of ``prompt + response[:-1]`` (the last generated token was never fed): its
        cached columns, then its new prompt columns and generated ones (`kv_reuse.batch_layout`)."""
        if not cache_supports_reuse(cache):
            self._kv_unsupported = True
            logger.warning(
                "kv_reuse is off for this model: its generate cache is %s (reuse needs a DynamicCache of full-attention "
                "layers; sliding-window and linear-attention layers cannot be cut per row)",
                type(cache).__name__,
            )
            return
        for row, (key, rollout) in enumerate(zip(keys, rollouts, strict=True)):
            if key is None:
                continue
            kept, new = len(rollout.response_ids) - 1, len(rollout.prompt_ids) - cached[row]
            spans = [(width_cached - cached[row], width_cached), (width - new, width + kept)]
            assert width + kept <= cache.layers[0].keys.shape[2]
            ids = rollout.prompt_ids + rollout.response_ids[:-1]
            self.kv_cache.put(key, session_from_cache(cache, row, spans, ids))

    def _run_generate(
        self,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        params: SamplingParams,
        extra: dict[str, Any],
        past: Any = None,
    ) -> Any:
        # With ``past`` (a batched cache of the first columns), HF feeds only the columns after it.
        return self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            max_new_tokens=params.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            past_key_values=past,
            output_logits=True,
            return_dict_in_generate=True,
            do_sample=False,
            **extra,
        )

    def _rollouts(
        self,
        rows: list[tuple[int, list[int]]],
        result: Any,
        new_tokens_dev: torch.Tensor,
        greedy: bool,
        params: SamplingParams,
        routing: list[torch.Tensor] | None,
    ) -> list[Rollout]:
        # Raw logits of every step [B, steps, V] -> log-probs of the sampling distribution, on the
        # generating device (on a GPU, copying [B, steps, V] to the host first costs more than generating).
        logits = torch.stack(result.logits, dim=1).float()
        scale = 1.0 if greedy else params.temperature
        logprobs = F.log_softmax(logits / scale, dim=-1).gather(-1, new_tokens_dev[..., None])[..., 0].cpu()
        new_tokens = new_tokens_dev.cpu()
        del logits
        rollouts = []
        for row, (prompt_index, prompt) in enumerate(rows):
            tokens = new_tokens[row].tolist()
            finished = self.eos_id is not None and self.eos_id in tokens
            length = tokens.index(self.eos_id) + 1 if finished else len(tokens)
            response = tokens[:length]
            rollouts.append(
                Rollout(
                    prompt_index=prompt_index,
                    prompt_ids=prompt,
                    response_ids=response,
                    logprobs=logprobs[row, :length].tolist(),
                    finished=finished,
                    version=self.version,
                    text=self.tokenizer.decode(response, skip_special_tokens=True),
                    routed_experts=routing[row][: len(prompt) + length] if routing is not None else None,
                )
            )
        return rollouts
