"""Where an RL trainer's rollouts run: ``rollout.placement: colocated | disaggregated``.

- ``colocated`` (default): the rollout engine lives in every trainer process (the embedded HF engine, or a
  vLLM engine/server the trainer starts), as it always did.
- ``disaggregated`` (``--launcher ray`` only), placed in the same placement group as the trainer ranks:
  - ``rollout.engine: hf``: ``rollout.num_actors`` Ray actors of their own, each holding the embedded HF engine
    (`shardforge.rollout.ray.hf_actor.RolloutActor`). Trainer rank ``r`` generates through actor
    ``r % rollout.num_actors``; after each step trainer rank 0 sends the new weights to every actor over
    weight-sync's collective transport (a gloo group of rank 0 + the actors, verified, version-tagged; no shared
    filesystem). With ``async_rollouts`` (and streaming) the versions go to disk under ``output_dir/weights``
    instead and every generate call names the version it needs, which the actor loads first (on several Ray nodes
    ``output_dir`` must be on storage rank 0's and the actors' nodes share); with ``rollout.partial_rollouts`` the
    actor also loads the newest published version between two chunks of a call.
  - ``rollout.engine: vllm`` with ``rollout.vllm.mode: server``: one actor that runs ``vllm serve`` in its bundle
    (`shardforge.rollout.ray.vllm_server.VLLMServerActor`); every rank is a `VLLMServerRolloutEngine`
    on its URL, and trainer rank 0 sends the server every version over weight-sync's collective transport
    (``rollout.vllm.weight_transport: auto``; ``disk``: the server loads the versions under ``output_dir/weights``, which
    on several Ray nodes must be on storage the trainer's rank 0 and the server's node share).

This module is the pure part (no Ray import): the refusals, the actors' spec the launcher needs, and how
the launcher tells the ranks the actors' names (an environment variable, as it passes the rank variables).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardforge.rewards.ray_pool import actor_names_from_env
from shardforge.rollout.config import RolloutConfig, RolloutOnActorFailure, RolloutPlacement

__all__ = [
    "ROLLOUT_ACTORS_ENV",
    "RolloutActorSpec",
    "RolloutOnActorFailure",
    "RolloutPlacement",
    "actor_for_rank",
    "actor_names",
    "actor_names_from_env",
    "rollout_actor_names_from_env",
    "rollout_actor_spec",
]

ROLLOUT_ACTORS_ENV = "SHARDFORGE_RAY_ROLLOUT_ACTORS"
"""Set by the Ray launcher on every rank: the rollout actors' names, comma-separated."""

_HOW = "docs/multinode.md, 'Disaggregated rollouts'"


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutActorSpec:
    """What the Ray launcher needs to start the rollout actors (read from the trainer config)."""

    num_actors: int
    """Rollout actors to start (each holds one embedded HF engine with the full model, or one vLLM server)."""
    engine: str = "hf"
    """``rollout.engine``: ``hf`` (`RolloutActor`) or ``vllm`` (`VLLMServerActor`, ``rollout.vllm.mode: server``)."""
    model: str
    """HF model directory of the initial weights (version 0)."""
    tokenizer: str
    """Tokenizer directory (the trainer's ``tokenizer``, else the model directory)."""
    dtype: str
    """The rollout model's dtype (``rollout.dtype``)."""
    kv_reuse: bool
    """``rollout.kv_reuse``: keep multi-turn sessions' KV caches between calls."""
    kv_reuse_max_tokens: int
    """``rollout.kv_reuse_max_tokens``."""
    share_prefill: bool = True
    """``rollout.share_prefill``: encode each distinct prompt of a call once."""
    batch_size: int = 256
    """``rollout.batch_size``: most rows per ``generate`` call."""
    interrupt_chunk_tokens: int = 0
    """engine=hf with ``rollout.partial_rollouts``: the actor generates this many new tokens at a time and loads the
    newest published disk version between chunks (``rollout.interrupt_chunk_tokens``); 0: whole calls."""
    vllm: Any = None
    """engine=vllm: the trainer's `VLLMOptions` (the server's flags and environment)."""
    seed: int = 0
    """engine=vllm: the server's global seed (requests carry their own)."""
    output_dir: str = ""
    """engine=vllm: the run's ``output_dir``, absolute (the server's log goes to ``output_dir/vllm_server.log``)."""

    @property
    def gpus_per_actor(self) -> int:
        """GPUs one actor's bundle asks for when the cluster has GPUs (a vLLM server: its tensor-parallel size)."""
        return int(self.vllm.tensor_parallel_size) if self.engine == "vllm" else 1


def rollout_actor_spec(config: Any, launcher: str, world_size: int | None = None) -> RolloutActorSpec | None:
    """The rollout actors ``config`` asks for (None: colocated); raise `ValueError` for a combination that is
    not supported (``launcher``: the CLI's ``--launcher``, or ``"external"`` under an outside torchrun;
    ``world_size``: the trainer's ranks, when known; no refusal depends on it at present)."""
    rollout: RolloutConfig = getattr(config, "rollout", None) or RolloutConfig()
    placement, num_actors, on_failure = rollout.placement, rollout.num_actors, rollout.on_actor_failure
    if placement == "colocated":
        if on_failure != "error":
            raise ValueError(
                f"rollout.on_actor_failure={on_failure} applies to the rollout actors of rollout.placement="
                "disaggregated (--launcher ray); this run's rollouts are colocated: remove it, or set "
                f"rollout.placement=disaggregated ({_HOW})"
            )
        return None
    if placement != "disaggregated":
        raise ValueError(f"rollout.placement={placement!r} is not one of ['colocated', 'disaggregated']")
    engine, vllm = rollout.engine, rollout.vllm
    refusals = [
        (
            launcher != "ray",
            f"runs the rollout engine in Ray actors, which only --launcher ray starts (this run's launcher: "
            f"{launcher}): add --launcher ray, or set rollout.placement=colocated",
        ),
        (
            engine not in ("hf", "vllm"),
            f"holds the embedded HF engine or a vLLM server; rollout.engine={engine!r} is neither: use "
            "rollout.engine=hf or rollout.engine=vllm with rollout.vllm.mode=server",
        ),
        *(_vllm_refusals(vllm, num_actors, on_failure, rollout.partial_rollouts) if engine == "vllm" else []),
        (
            on_failure == "drop" and engine == "hf" and num_actors < 2,
            f"with rollout.on_actor_failure=drop moves the ranks of a dead rollout actor to a surviving one, which "
            f"needs rollout.num_actors >= 2 (rollout.num_actors={num_actors}): raise it, or set "
            "rollout.on_actor_failure=error",
        ),
        (
            bool(getattr(config, "async_rollouts", False)) and engine == "hf" and on_failure == "drop",
            "with rollout.on_actor_failure=drop agrees on dead actors with the ranks' collectives once per generation "
            "round, which asynchronous rollouts run on a background thread: set rollout.on_actor_failure=error, or "
            "async_rollouts=false",
        ),
        (
            bool(getattr(config, "async_rollouts", False))
            and engine == "vllm"
            and vllm.weight_transport == "collective",
            "with async_rollouts loads weight versions from disk when its generator needs them; "
            "rollout.vllm.weight_transport=collective switches the server at every publish: set "
            "rollout.vllm.weight_transport=auto or disk",
        ),
        (
            bool(getattr(getattr(config, "engine", None), "router_replay", False)),
            "does not return recorded MoE routing yet: set engine.router_replay=false",
        ),
        (
            rollout.sleep or bool(getattr(config, "offload_train_state_during_rollout", False)),
            "gives the rollout engine devices of its own: rollout.sleep and offload_train_state_during_rollout hand "
            "a colocated engine's devices to the trainer between phases; set them to false",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"rollout.placement=disaggregated {why} ({_HOW})")
    return RolloutActorSpec(
        num_actors=num_actors,
        engine=engine,
        model=str(config.model),
        tokenizer=str(getattr(config, "tokenizer", None) or config.model),
        dtype=rollout.dtype,
        kv_reuse=rollout.kv_reuse,
        kv_reuse_max_tokens=rollout.kv_reuse_max_tokens,
        share_prefill=rollout.share_prefill,
        batch_size=rollout.batch_size,
        interrupt_chunk_tokens=rollout.interrupt_chunk_tokens if rollout.partial_rollouts else 0,
        vllm=vllm if engine == "vllm" else None,
        seed=int(getattr(config, "seed", 0)),
        output_dir=str(Path(config.output_dir).resolve()) if getattr(config, "output_dir", "") else "",
    )


def _vllm_refusals(vllm: Any, num_actors: int, on_failure: str, partial_rollouts: bool) -> list[tuple[bool, str]]:
    """What ``rollout.engine=vllm`` with disaggregated placement (one `VLLMServerActor`) does not support yet."""
    mode = getattr(vllm, "mode", "in_process")
    return [
        (
            mode != "server",
            f"runs vLLM as a server actor: set rollout.vllm.mode=server (rollout.vllm.mode={mode!r} runs vLLM inside the trainer, "
            "rollout.placement=colocated)",
        ),
        (
            getattr(vllm, "server_url", None) is not None,
            "starts its own vLLM server in a Ray actor: remove rollout.vllm.server_url, or keep it with "
            "rollout.placement=colocated",
        ),
        (
            on_failure != "error",
            f"with rollout.engine=vllm starts one vLLM server, which is restarted rather than dropped: set "
            f"rollout.on_actor_failure=error (it is {on_failure}) and rollout.vllm.on_server_failure=restart",
        ),
        (
            num_actors != 1,
            f"with rollout.engine=vllm starts one vLLM server for every rank (rollout.num_actors={num_actors}): set "
            "rollout.num_actors=1 (rollout.vllm.max_num_seqs and rollout.vllm.tensor_parallel_size size the server)",
        ),
        (
            partial_rollouts,
            "with rollout.engine=vllm does not interrupt the server's generations: set rollout.partial_rollouts=false, "
            "or use rollout.engine=hf (its actors interrupt a call at a chunk boundary)",
        ),
    ]


def actor_names(num_actors: int, prefix: str = "shardforge-rollout") -> list[str]:
    """The Ray names of ``num_actors`` rollout actors."""
    return [f"{prefix}-{index}" for index in range(num_actors)]


def actor_for_rank(rank: int, num_actors: int) -> int:
    """The rollout actor trainer rank ``rank`` generates through (round robin)."""
    if num_actors < 1 or rank < 0:
        raise ValueError(f"rank={rank} and num_actors={num_actors} must be >= 0 and >= 1")
    return rank % num_actors


def rollout_actor_names_from_env(num_actors: int, env: Mapping[str, str] | None = None) -> list[str]:
    """The actors the Ray launcher started for this run (``ROLLOUT_ACTORS_ENV``); a `ValueError` when this
    rank was not started by ``--launcher ray`` with ``rollout.placement=disaggregated``, or with another count."""
    return actor_names_from_env(
        ROLLOUT_ACTORS_ENV,
        num_actors,
        kind="rollout",
        needs="rollout.placement=disaggregated",
        instead=f"rollout.placement=colocated ({_HOW})",
        env=env,
    )
