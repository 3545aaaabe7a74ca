"""``sample`` / ``compute_logprobs`` on the embedded HF rollout engine (`shardforge.rollout.HFRolloutEngine`).

One engine serves every sampling session. Its weights follow the session being served: switching to another
saved sampler publishes that sampler's merged weights (base + its LoRA delta) into the engine's
`WeightReceiver` in process, as a new weight version (weight-sync's `InProcessTransport`, the same path our
trainers use for a colocated engine). Consecutive requests of one sampler cost no switch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardforge.algorithms.serve.codecs import SampledSequenceOut, encode_sample_response
from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.models import ModelRegistry, SamplerWeights
from shardforge.rollout import SamplingParams

__all__ = ["SampleJob", "SamplerEngine", "truncate_at_stop"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleJob:
    """A checked sample request."""

    prompt: list[int]
    params: SamplingParams
    stop: Any
    """Tinker's ``stop``: None, a string, strings or token ids."""
    prompt_logprobs: bool


def truncate_at_stop(tokens: list[int], tokenizer: Any, stop: Any) -> tuple[int, bool]:
    """How many of ``tokens`` to keep under Tinker's ``stop`` (token ids or strings; the stop is kept), and
    whether a stop sequence ended them."""
    if stop is None or stop == []:
        return len(tokens), False
    stops = [stop] if isinstance(stop, (str, int)) else list(stop)
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stops):
        hit = next((i for i, t in enumerate(tokens) if t in stops), None)
        return (len(tokens), False) if hit is None else (hit + 1, True)
    if not all(isinstance(s, str) and s for s in stops):
        raise UserError(f"sampling_params.stop={stop!r} must be a string, a list of strings or a list of token ids")
    for keep in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:keep], skip_special_tokens=True)
        if any(s in text for s in stops):
            return keep, True
    return len(tokens), False


class SamplerEngine:
    """The HF rollout engine plus which sampler's weights it serves."""

    def __init__(self, registry: ModelRegistry, *, max_tokens: int) -> None:
        from shardforge.rollout import HFRolloutEngine

        self.registry = registry
        self.max_tokens = max_tokens
        self.engine = HFRolloutEngine(registry.model_dir, registry.tokenizer, kv_reuse=False)
        self._serving: str | None = None  # the served sampler's path (None: the base model)

    def _serve(self, weights: SamplerWeights) -> None:
        if weights.path == self._serving:
            return
        from shardforge.lora import apply_lora, merged_lora
        from shardforge.weight_sync import InProcessTransport, WeightPublisher

        tree = self.registry.shared_tree()
        if weights.lora is None and weights.adapter is not None:  # full fine-tuning: a full copy of the weights
            tree = self.registry.full_copy()
            tree.load_state_dict(weights.adapter, strict=False)
        elif weights.lora is not None and weights.adapter is not None:
            apply_lora(tree, weights.lora, seed=0)
            missing = set(weights.adapter) - {n for n, _ in tree.named_parameters()}
            assert not missing, f"adapter names missing from the tree: {sorted(missing)[:4]}"
            tree.load_state_dict(weights.adapter, strict=False)
        # merged_lora folds the delta into the (shared) base weights and restores them exactly on exit; the single
        # worker thread runs nothing else meanwhile.
        with merged_lora(tree):
            publisher = WeightPublisher(tree, InProcessTransport(self.engine.receiver), src_rank=None, checksums=None)
            publisher.publish(self.engine.version + 1)
        self._serving = weights.path

    def parse(self, request: dict[str, Any]) -> SampleJob:
        """Check a ``SampleRequest`` (JSON) before it is queued; UserError says what is wrong."""
        prompt = _prompt_tokens(request.get("prompt"), self.registry.vocab_size)
        params = request.get("sampling_params") or {}
        num_samples = int(request.get("num_samples", 1))
        max_tokens = int(params.get("max_tokens") or 16)
        if not 1 <= num_samples <= 128:
            raise UserError(f"num_samples={num_samples} must be in [1, 128]")
        if not 1 <= max_tokens <= self.max_tokens:
            raise UserError(f"sampling_params.max_tokens={max_tokens} must be in [1, {self.max_tokens}] (--max-tokens)")
        context = self.registry.max_context
        if context is not None and len(prompt) + max_tokens > context:
            raise UserError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed the context of {context}"
            )
        top_k = int(params.get("top_k", -1))
        if top_k < -1:
            raise UserError(f"sampling_params.top_k={top_k} must be -1 (no limit) or >= 1")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if int(request.get(key) or 0):
                raise UserError(f"{key} is not supported yet; leave it at 0")
        if request.get("target_prompt_logprobs") is not None:
            raise UserError("target_prompt_logprobs is not supported yet")
        truncate_at_stop([], self.registry.tokenizer, params.get("stop"))  # checks the stop's type
        seed = params.get("seed")
        sampling = SamplingParams(
            n=num_samples,
            max_new_tokens=max_tokens,
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=max(top_k, 0),  # Tinker's -1 (no limit) is our 0 (off)
            seed=None if seed is None else int(seed) % (2**62),
        )
        return SampleJob(
            prompt=prompt,
            params=sampling,
            stop=params.get("stop"),
            prompt_logprobs=bool(request.get("prompt_logprobs")),
        )

    def sample(self, weights: SamplerWeights, job: SampleJob) -> bytes:
        """Generate on the engine serving ``weights``; the SampleResponse protobuf."""
        self._serve(weights)
        sequences = []
        for rollout in self.engine.generate([job.prompt], job.params):
            keep, stopped = truncate_at_stop(rollout.response_ids, self.registry.tokenizer, job.stop)
            sequences.append(
                SampledSequenceOut(
                    tokens=rollout.response_ids[:keep],
                    logprobs=rollout.logprobs[:keep],
                    stopped=stopped or (rollout.finished and keep == len(rollout.response_ids)),
                )
            )
        prompt_lp = self._prompt_logprobs(job.prompt) if job.prompt_logprobs else None
        return encode_sample_response(sequences, prompt_lp)

    @torch.no_grad()
    def _prompt_logprobs(self, prompt: Sequence[int]) -> list[float]:
        model = self.engine.model
        ids = torch.tensor([list(prompt)], device=next(model.parameters()).device)
        logprobs = F.log_softmax(model(input_ids=ids).logits.float()[0, :-1], dim=-1)
        scored = logprobs.gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist()
        return [float("nan"), *scored]


def _prompt_tokens(prompt: Any, vocab_size: int) -> list[int]:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserError("prompt must be a ModelInput: {'chunks': [{'type': 'encoded_text', 'tokens': [...]}]}")
    tokens: list[int] = []
    for chunk in prompt["chunks"]:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise UserError(f"prompt chunks of type {kind!r} are not supported yet (only encoded_text)")
        tokens += [int(t) for t in chunk.get("tokens", [])]
    if not tokens:
        raise UserError("the prompt is empty")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise UserError(f"prompt token ids must be in [0, {vocab_size})")
    return tokens
