"""The ``rollout:`` config section: which rollout engine generates, where it runs and with which options.

One section for every engine (`RolloutConfig`); `shardforge.rollout.factory.build_rollout` turns it into a built
engine and its weight publisher. The RL trainers (GRPO, PPO, distill) take it as ``rollout:``; a user's own loop
can build one directly::

    rollout = build_rollout(RolloutConfig(engine="hf", kv_reuse=True), model_dir, tokenizer)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shardforge.rollout.engines import ROLLOUT_ENGINES

__all__ = ["STREAMING_LATE_GROUPS", "RolloutConfig", "RolloutOnActorFailure", "RolloutPlacement", "VLLMOptions"]

PLACEMENTS = ("rank0", "each_rank")
MODES = ("in_process", "server")
ON_SERVER_FAILURE = ("error", "restart")
WEIGHT_TRANSPORTS = ("auto", "disk", "collective")
RolloutPlacement = Literal["colocated", "disaggregated"]
"""Where the rollout engine runs: in every trainer process, or in Ray actors of its own."""
RolloutOnActorFailure = Literal["error", "drop"]
StreamingLateGroups = Literal["defer", "wait", "regenerate"]
STREAMING_LATE_GROUPS: tuple[str, ...] = ("defer", "wait", "regenerate")
"""The values of ``rollout.streaming_late_groups`` (what they do: ``shardforge.algorithms.trainers.rl.streaming_late``)."""
"""What the ranks do when an HF rollout actor dies: end the run with a one-line error, or drop it from the pool
and regenerate the lost rounds on a surviving actor (`shardforge.rollout.ray.actor_pool`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VLLMOptions:
    """Settings of the vLLM rollout engine (the ``rollout.vllm`` section of the RL configs)."""

    mode: Literal["in_process", "server"] = "in_process"
    """in_process: ``vllm.LLM`` inside the trainer process; server: an OpenAI-compatible vLLM server
    over HTTP (`VLLMServerRolloutEngine`)."""
    placement: Literal["rank0", "each_rank"] = "rank0"
    """in_process: which trainer ranks own a vLLM instance (see the module docstring). A server
    is always started by rank 0 and shared."""
    server_url: str | None = None
    """server: URL of a running server (started with the flags in `shardforge.rollout.vllm.server`);
    None = rank 0 starts one."""
    server_python: str | None = None
    """server: interpreter that starts the server (e.g. another venv's python with vLLM); None = this one."""
    server_startup_timeout_s: float = 900.0
    """server: how long to wait for a started server to answer /health."""
    health_timeout_s: float = 10.0
    """server: /health must answer within this long (checked before every `generate` and after a failed
    request), else the server counts as down (see `shardforge.rollout.server.health`)."""
    request_timeout_s: float = 600.0
    """server: longest wait for one completion request; a request past it counts as a failure."""
    on_server_failure: Literal["error", "restart"] = "error"
    """server: error = stop with a one-line error naming the server; restart = restart a server this
    trainer started, restore the current weight version and resend the batch's requests."""
    max_server_restarts: int = 3
    """server, on_server_failure=restart: restarts allowed over the run before the error is raised."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of GPU memory vLLM may take (the trainer shares the GPU)."""
    kv_cache_space_gib: int = 1
    """CPU only: KV-cache size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``, unless already set; vLLM's
    default is far larger)."""
    max_model_len: int | None = None
    """Longest prompt + response in tokens (None = the model's max_position_embeddings)."""
    max_num_seqs: int = 256
    """Sequences vLLM decodes at once."""
    enforce_eager: bool = True
    """Skip CUDA graphs / torch.compile (faster start-up; slower decoding on GPUs)."""
    tensor_parallel_size: int = 1
    """vLLM workers per instance (tensor parallel)."""
    enable_prefix_caching: bool = True
    """Share prompt KV blocks between the n samples of a prompt (reset after every weight update)."""
    enable_sleep_mode: bool = False
    """CUDA only: start vLLM with its sleep mode, so `sleep` can discard weights and KV cache between generation
    phases (`rollout.vllm_sleep`); the RL trainers set it with ``rollout.sleep=true``."""
    weight_transport: Literal["auto", "disk", "collective"] = "auto"
    """server: how each weight version reaches the server. disk: weight-sync versions under output_dir/weights that
    the server loads (it must see that directory); collective: trainer rank 0 sends them to the server's workers
    over weight-sync's collective transport (no shared filesystem; `rollout.vllm_server_collective`); auto:
    collective for the Ray server actor (rollout.placement=disaggregated), disk otherwise."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rollout.vllm.mode={self.mode!r} is not one of {list(MODES)}")
        if self.server_startup_timeout_s <= 0:
            raise ValueError(f"rollout.vllm.server_startup_timeout_s={self.server_startup_timeout_s} must be > 0")
        if self.health_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError(
                f"rollout.vllm.health_timeout_s={self.health_timeout_s} and rollout.vllm.request_timeout_s={self.request_timeout_s} must be > 0"
            )
        if self.on_server_failure not in ON_SERVER_FAILURE:
            raise ValueError(
                f"rollout.vllm.on_server_failure={self.on_server_failure!r} is not one of {list(ON_SERVER_FAILURE)}"
            )
        if self.max_server_restarts < 0:
            raise ValueError(f"rollout.vllm.max_server_restarts={self.max_server_restarts} must be >= 0")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"rollout.vllm.placement={self.placement!r} is not one of {list(PLACEMENTS)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"rollout.vllm.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_space_gib < 1:
            raise ValueError(f"rollout.vllm.kv_cache_space_gib={self.kv_cache_space_gib} must be a whole number >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"rollout.vllm.max_model_len={self.max_model_len} must be >= 2 (or None = the model's)")
        if self.max_num_seqs < 1:
            raise ValueError(f"rollout.vllm.max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"rollout.vllm.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"rollout.vllm.weight_transport={self.weight_transport!r} is not one of {list(WEIGHT_TRANSPORTS)}"
            )
        if self.weight_transport == "collective" and self.enable_sleep_mode:
            raise ValueError(
                "rollout.vllm.enable_sleep_mode (rollout.sleep) is woken by the disk weight switch; with "
                "rollout.vllm.weight_transport=collective it is not built yet: set rollout.vllm.weight_transport=disk or rollout.sleep=false"
            )
        if self.weight_transport == "collective" and self.mode != "server":
            raise ValueError(
                "rollout.vllm.weight_transport=collective sends weights to a vLLM server: set rollout.vllm.mode=server, or use "
                "rollout.vllm.weight_transport=disk (the in-process engine loads disk versions)"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """How trajectories are generated (the ``rollout:`` section of the GRPO, PPO and distill configs)."""

    engine: str = "hf"
    """A name in `ROLLOUT_ENGINES` (``hf``: embedded HF generate in every trainer process; ``vllm``: vLLM, see
    ``vllm``) or a user's engine builder as ``package.module:function`` (`shardforge list` shows the names)."""
    dtype: str = "float32"
    """Dtype of the rollout model and of the weights published to it."""
    placement: RolloutPlacement = "colocated"
    """colocated: the rollout engine in every trainer process. disaggregated (``--launcher ray``): engine=hf runs
    the embedded HF engine in ``num_actors`` Ray actors of their own, weights over weight-sync's collective transport
    after every step; engine=vllm with vllm.mode=server runs one Ray actor with ``vllm serve`` (weights over the
    collective transport, or disk versions with vllm.weight_transport=disk). See docs/multinode.md."""
    num_actors: int = 1
    """placement=disaggregated: rollout actors (trainer rank r generates through actor r % num_actors; 1 with
    engine=vllm)."""
    on_actor_failure: RolloutOnActorFailure = "error"
    """placement=disaggregated with engine=hf: a dead rollout actor ends the run with a one-line error ('error'), or
    is dropped: its ranks move to a surviving actor and generate their whole round again there ('drop',
    num_actors >= 2). A vLLM server actor is restarted instead (vllm.on_server_failure)."""
    sleep: bool = False
    """placement=colocated: the rollout engine frees its weights and KV caches after each batch's generation and
    gets them back with the next published version, so the training phase has the device memory (verl's
    free_cache_engine / vLLM sleep mode; vLLM: CUDA only). Synchronous rollouts only. See docs/rl-placement.md."""
    publish_in_memory: bool = True
    """With the embedded HF engine in the trainer's processes (synchronous), hand the new weights to every rank's
    engine in memory instead of a weight-sync version on disk (output_dir/weights); false: always through disk."""
    kv_reuse: bool = True
    """engine=hf: keep each episode's KV cache between its turns (and between partial-rollout chunks) and prefill
    only the tokens a turn adds; dropped on every weight change. false: re-encode the context every turn."""
    kv_reuse_max_tokens: int = 65536
    """engine=hf: most tokens of KV cache kept over all live episodes (the oldest episodes' go first)."""
    share_prefill: bool = True
    """engine=hf: encode each distinct prompt of a generate call once, not once per sample (a GRPO group's prompt
    is prefilled once); false: one prefill per sample."""
    batch_size: int = 256
    """engine=hf: most rows (prompts x samples) per ``generate`` call; larger calls are split."""
    partial_rollouts: bool = False
    """Asynchronous rollouts (GRPO's async_rollouts, also with streaming_rollouts): interrupt in-flight generations when
    new weights are published and continue them under the new weights (every token records its version and behaviour
    log-prob)."""
    interrupt_chunk_tokens: int = 16
    """partial_rollouts: tokens generated between two checks for newer weights (smaller: fresher, more recompute)."""
    streaming_workers: int = 1
    """Streaming rollouts (streaming_rollouts=true): generator threads per rank, each with one generate call in flight
    (a rank's share of a batch split between them); > 1 needs an engine that serves concurrent requests (engine=vllm
    with vllm.mode=server, or placement=disaggregated). A weight switch waits until no call is in flight."""
    streaming_late_groups: StreamingLateGroups = "defer"
    """Streaming rollouts: a group still generating when the last step its staleness bound allows takes its batch.
    'defer': released, its prompt started again once a batch's worth is deferred (or the run's other prompts are all
    started), and that second attempt is waited for; 'wait': that step waits for it (nothing generated is thrown
    away); 'regenerate': released and started again at once. Every mode keeps the bound strict."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """vLLM options (engine=vllm only): in process or a server, placement, timeouts, memory, weight transport."""

    def __post_init__(self) -> None:
        if self.num_actors < 1:
            raise ValueError(f"rollout.num_actors={self.num_actors} must be >= 1")
        if self.kv_reuse_max_tokens < 1:
            raise ValueError(f"rollout.kv_reuse_max_tokens={self.kv_reuse_max_tokens} must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"rollout.batch_size={self.batch_size} must be >= 1")
        if self.streaming_workers < 1:
            raise ValueError(
                f"rollout.streaming_workers={self.streaming_workers} must be >= 1 (generator threads per rank with "
                "streaming_rollouts=true; 1 is the default)"
            )
        if self.streaming_late_groups not in STREAMING_LATE_GROUPS:
            raise ValueError(
                f"rollout.streaming_late_groups={self.streaming_late_groups!r} is not one of {STREAMING_LATE_GROUPS} "
                "(what a streamed group unfinished at the last step its staleness bound allows does; 'defer' is the "
                "default)"
            )
        if self.interrupt_chunk_tokens < 1:
            raise ValueError(
                f"rollout.interrupt_chunk_tokens={self.interrupt_chunk_tokens} must be >= 1 (tokens generated "
                "between two checks for newer weights; 16 is the default)"
            )
        if ":" not in self.engine and self.engine not in ROLLOUT_ENGINES:
            raise ValueError(
                f"rollout.engine: {self.engine!r} is not one of {ROLLOUT_ENGINES.names()} (the registered rollout "
                "engines; a user's builder is named as 'package.module:function')"
            )
        if not isinstance(self.vllm, VLLMOptions):
            raise TypeError(f"rollout.vllm must be VLLMOptions, got {type(self.vllm).__name__}")
