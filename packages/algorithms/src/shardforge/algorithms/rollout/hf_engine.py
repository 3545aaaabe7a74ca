"""The embedded rollout engine: HF ``generate`` on a local copy of the policy.

It runs inside each trainer process (or any side process): it loads the initial HF model
directory, samples responses with their behaviour log-probs, and refreshes its weights from
versions that the trainer publishes with weight-sync (`DiskTransport` -> `DiskWeightSource`
-> `WeightReceiver`: verified, all-or-nothing, monotonic versions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList, TopPLogitsWarper

from shardforge.algorithms.engine.config import parse_dtype
from shardforge.algorithms.rollout.seeds import SEED_LIMIT, prompt_seeds
from shardforge.algorithms.rollout.types import Rollout, SamplingParams
from shardforge.weight_sync import DiskWeightSource, WeightReceiver, WeightVersionError

__all__ = ["HFRolloutEngine"]


class HFRolloutEngine:
    """Sample with ``transformers`` ``generate``; weights follow a weight-sync disk root.

    Args:
        model_dir: HF model directory with the initial weights (version 0).
        tokenizer: the tokenizer (pad/eos ids and decoding).
        weights_root: where the trainer publishes versions (`DiskTransport` root); None = never
            refreshed.
        dtype: dtype of the rollout model ("float32", "bf16", ...).
        batch_size: rows per ``generate`` call (prompts x samples are chunked).
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
    ) -> None:
        from transformers import AutoModelForCausalLM

        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"rollout model directory {str(model_dir)!r} does not exist")
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=parse_dtype(dtype))
        self.model = model.to(self.device)  # type: ignore[arg-type]
        self.model.eval()
        self.model.config.use_cache = True
        self.receiver = WeightReceiver(self.model)
        self.replay: Any = None
        """A `shardforge.moe_ep.RouterReplay` when routing is recorded (`record_routing`)."""
        self.source = DiskWeightSource(weights_root) if weights_root is not None else None
        self.batch_size = batch_size
        self.interrupt_chunk_tokens: int | None = None
        """Partial rollouts: generate in chunks of this many tokens, calling `between_chunks` after each
        (None: one ``generate`` call per batch)."""
        self.between_chunks: Callable[[], None] | None = None
        """Called between two chunks; it may switch the weights (`update_weights`), and the rest of every
        unfinished response is then generated, and its log-probs taken, under the new ones."""
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token; generation needs one to pad prompts")

    def record_routing(self) -> None:
        """Record each token's top-k experts per MoE layer into `Rollout.routed_experts` (router replay)."""
        from shardforge.moe_ep import RouterReplay

        self.replay = RouterReplay(self.model)

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
        return self.receiver.version

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        """``len(prompts) * params.n`` rollouts, prompt by prompt (each prompt's samples together).

        Sample ``j`` of prompt ``i`` draws from its own generator, seeded ``seeds[i] + j`` (`rollout.seeds`):
        what it samples does not depend on the other rows of the batch, on ``batch_size`` or on chunking."""
        if len(prompts) == 0:
            raise ValueError("generate() needs at least one prompt")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        uniforms = None if params.temperature == 0 else _row_uniforms(params, len(prompts))
        out: list[Rollout] = []
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            draws = None if uniforms is None else uniforms[start : start + self.batch_size]
            if self.interrupt_chunk_tokens is not None:
                out += self._generate_interruptible(batch, params, draws)
            else:
                out += self._generate_chunk(batch, params, draws)
        return out

    def _generate_interruptible(
        self, rows: list[tuple[int, list[int]]], params: SamplingParams, uniforms: torch.Tensor | None
    ) -> list[Rollout]:
        """Partial rollouts: ``interrupt_chunk_tokens`` new tokens at a time; between chunks `between_chunks`
        may load newer weights, and unfinished rows continue from their prompt + generated ids (the
        context is recomputed under the new weights, as AReaL's interruptible generation does). Rows that
        finished leave the batch. Every token keeps the version and behaviour log-prob that produced it."""
        assert self.interrupt_chunk_tokens is not None and self.replay is None
        ids: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        versions: list[list[int]] = [[] for _ in rows]
        finished = [False] * len(rows)
        active, remaining = list(range(len(rows))), params.max_new_tokens
        while True:
            budget = min(self.interrupt_chunk_tokens, remaining)
            context = [(rows[i][0], rows[i][1] + ids[i]) for i in active]
            # Unfinished rows generated every token so far: each continues at the same position of its stream.
            done = params.max_new_tokens - remaining
            draws = None if uniforms is None else uniforms[active, done : done + budget]
            parts = self._generate_chunk(context, dataclasses.replace(params, max_new_tokens=budget), draws)
            for i, part in zip(active, parts, strict=True):
                ids[i] += part.response_ids
                logprobs[i] += part.logprobs
                versions[i] += [part.version] * len(part.response_ids)
                finished[i] = part.finished
            active, remaining = [i for i in active if not finished[i]], remaining - budget
            if not active or remaining <= 0:
                break
            if self.between_chunks is not None:
                self.between_chunks()
        return [
            Rollout(
                prompt_index=prompt_index,
                prompt_ids=prompt,
                response_ids=ids[i],
                logprobs=logprobs[i],
                finished=finished[i],
                version=min(versions[i]),
                text=self.tokenizer.decode(ids[i], skip_special_tokens=True),
                token_versions=versions[i],
            )
            for i, (prompt_index, prompt) in enumerate(rows)
        ]

    def _generate_chunk(
        self, rows: list[tuple[int, list[int]]], params: SamplingParams, uniforms: torch.Tensor | None
    ) -> list[Rollout]:
        width = max(len(p) for _, p in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for row, (_, ids) in enumerate(rows):  # left padding: every prompt ends at the same column
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        greedy = uniforms is None
        # Sampling is the logits processor's (one uniform per row and token); `generate` then takes its argmax.
        sampler = [] if greedy else [_RowSampler(uniforms.to(self.device), width, params)]
        recording = self.replay.record() if self.replay is not None else contextlib.nullcontext(None)
        with recording as routed:
            result = self._run_generate(input_ids, attention, params, LogitsProcessorList(sampler))
        new_tokens_dev = result.sequences[:, width:]
        routing = routed_per_row(routed, rows, width, new_tokens_dev.shape[1]) if routed is not None else None
        return self._rollouts(rows, result, new_tokens_dev, greedy, params, routing)

    def _run_generate(
        self, input_ids: torch.Tensor, attention: torch.Tensor, params: SamplingParams, sampler: LogitsProcessorList
    ) -> Any:
        return self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            max_new_tokens=params.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            output_logits=True,
            return_dict_in_generate=True,
            do_sample=False,
            logits_processor=sampler,
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


def _row_uniforms(params: SamplingParams, num_prompts: int) -> torch.Tensor:
    """[rows, max_new_tokens] float64 uniforms: row (prompt i, sample j) from a generator seeded ``seeds[i] + j``
    (unseeded: seeds drawn from the global torch generator, so ``torch.manual_seed`` still fixes them). Drawn on
    the CPU, one short call per row: the same numbers on every device and machine."""
    seeds = prompt_seeds(params, num_prompts)
    if seeds is None:
        seeds = torch.randint(0, SEED_LIMIT - params.n, (num_prompts,)).tolist()
    generator = torch.Generator()
    draws = []
    for seed in seeds:
        for j in range(params.n):
            generator.manual_seed(seed + j)
            draws.append(torch.rand(params.max_new_tokens, generator=generator, dtype=torch.float64))
    return torch.stack(draws)


class _RowSampler(LogitsProcessor):
    """Samples each row's next token by inverting the CDF of its own softmax(scores / temperature) (top-p as HF's
    warper) at the row's uniform for this position, and leaves only that token finite (greedy search picks it).
    A row's sample depends on its logits and its uniform alone, never on the batch's other rows."""

    def __init__(self, uniforms: torch.Tensor, width: int, params: SamplingParams) -> None:
        self.uniforms, self.width, self.temperature = uniforms, width, params.temperature
        self.top_p = TopPLogitsWarper(params.top_p) if params.top_p < 1 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scaled = scores.float() / self.temperature
        if self.top_p is not None:
            scaled = self.top_p(input_ids, scaled)
        cdf = torch.softmax(scaled, dim=-1).double().cumsum(dim=-1)
        u = self.uniforms[:, input_ids.shape[1] - self.width, None] * cdf[:, -1:]
        # The first token whose CDF exceeds u (right=True: a zero-probability token is never picked).
        token = torch.searchsorted(cdf, u, right=True).clamp_(max=scores.shape[-1] - 1)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, token, 0.0)  # type: ignore[return-value]


def routed_per_row(
    routed: list[list[torch.Tensor]], rows: list[tuple[int, list[int]]], width: int, steps: int
) -> list[torch.Tensor]:
    """Per generate row, ``[width_of_its_prompt + steps, L, K]`` int16 experts from the router calls of one
    cached ``generate``: call 0 is the prefill (``B * width`` rows, prompts left-padded), call ``s >= 1``
    feeds generated token ``s - 1`` (``B`` rows). The last generated token is never fed: -1."""
    top_k = routed[0][0].shape[-1]
    prefill = torch.stack([calls[0].view(len(rows), width, top_k) for calls in routed], dim=2)  # [B, width, L, K]
    decode = torch.full((len(rows), steps, len(routed), top_k), -1, dtype=torch.int64)
    for s in range(1, len(routed[0])):
        decode[:, s - 1] = torch.stack([calls[s].view(len(rows), top_k) for calls in routed], dim=1)
    out = []
    for b, (_, prompt) in enumerate(rows):
        out.append(torch.cat([prefill[b, width - len(prompt) :], decode[b]]).to(torch.int16))
    return out
