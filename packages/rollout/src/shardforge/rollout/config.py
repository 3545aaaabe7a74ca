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
from shardforge.rollout.vllm.engine import VLLMOptions

__all__ = ["RolloutConfig", "RolloutOnActorFailure", "RolloutPlacement"]

RolloutPlacement = Literal["colocated", "disaggregated"]
"""Where the rollout engine runs: in every trainer process, or in Ray actors of its own."""
RolloutOnActorFailure = Literal["error", "drop"]
"""What the ranks do when an HF rollout actor dies: end the run with a one-line error, or drop it from the pool
and regenerate the lost rounds on a surviving actor (`shardforge.rollout.ray.actor_pool`)."""


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
    """Asynchronous rollouts (GRPO's async_rollouts): interrupt in-flight generations when new weights are published
    and continue them under the new weights (every token records its version and behaviour log-prob)."""
    interrupt_chunk_tokens: int = 16
    """partial_rollouts: tokens generated between two checks for newer weights (smaller: fresher, more recompute)."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """vLLM options (engine=vllm only): in process or a server, placement, timeouts, memory, weight transport."""

    def __post_init__(self) -> None:
        if self.num_actors < 1:
            raise ValueError(f"rollout.num_actors={self.num_actors} must be >= 1")
        if self.kv_reuse_max_tokens < 1:
            raise ValueError(f"rollout.kv_reuse_max_tokens={self.kv_reuse_max_tokens} must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"rollout.batch_size={self.batch_size} must be >= 1")
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
