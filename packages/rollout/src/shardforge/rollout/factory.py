"""ONE way to build a rollout engine: a `RolloutConfig` (the ``rollout:`` section) -> `build_rollout` -> a
`BuiltRollout`: the engine, built whole (every option through its constructor), and its `WeightPublisher`.

The engine comes from `ROLLOUT_ENGINES` by ``config.engine`` (``hf``, ``vllm``, or a user's builder by import path,
with `RolloutEngineBuilder`'s signature) for ``placement=colocated``, or is a client of the Ray launcher's rollout
actors for ``placement=disaggregated``. How weights reach it is chosen once, in `publish.choose_publisher`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import Any, Protocol

from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.config import RolloutConfig
from shardforge.rollout.engines import ROLLOUT_ENGINES
from shardforge.rollout.publish import WeightPublisher, choose_publisher
from shardforge.rollout.types import ReceivesInProcess, RolloutEngine
from shardforge.weight_sync import DiskWeightSource

__all__ = [
    "ROLLOUT_ENGINES",
    "BuiltRollout",
    "PublishedRolloutEngine",
    "RolloutEngineBuilder",
    "build_hf_engine",
    "build_rollout",
    "build_rollout_engine",
]


class PublishedRolloutEngine(RolloutEngine, Protocol):
    """A `RolloutEngine` that follows the versions a trainer publishes (``source``: their disk root, when any)."""

    source: DiskWeightSource | None


class RolloutEngineBuilder(Protocol):
    """``fn(model_dir, tokenizer, *, config, weights_root, seed, record_routing, chunks) -> PublishedRolloutEngine``:
    a rollout engine for ``model_dir`` built whole from ``config`` (a `RolloutConfig`).

    Optional keyword: a builder that also declares ``asynchronous: bool = False`` by name is called with
    ``asynchronous=``, True when generator threads will drive the engine (``async_rollouts``, streaming), e.g. to
    make a server that several trainer ranks share switch versions per call (the ``vllm`` builder). A builder without
    it is called exactly as before (`build_rollout_engine` reads its signature): the keyword is not part of this
    protocol's ``__call__``, so builders written against it stay valid."""

    def __call__(
        self,
        model_dir: str | os.PathLike[str],
        tokenizer: Any,
        *,
        config: RolloutConfig,
        weights_root: str | os.PathLike[str] | None,
        seed: int,
        record_routing: bool,
        chunks: ChunkedGeneration | None,
    ) -> PublishedRolloutEngine: ...


def build_hf_engine(
    model_dir: str | os.PathLike[str],
    tokenizer: Any,
    *,
    config: RolloutConfig,
    weights_root: str | os.PathLike[str] | None,
    seed: int,
    record_routing: bool,
    chunks: ChunkedGeneration | None,
) -> PublishedRolloutEngine:
    """embedded HF `generate` on the trainer's ranks (default)"""
    from shardforge.mesh import current_device
    from shardforge.rollout.hf.engine import HFRolloutEngine

    return HFRolloutEngine(
        model_dir, tokenizer, weights_root=weights_root, dtype=config.dtype,
        device=current_device(),  # this rank's accelerator when there is one (the class alone defaults to the CPU)
        batch_size=config.batch_size, kv_reuse=config.kv_reuse, kv_reuse_max_tokens=config.kv_reuse_max_tokens,
        share_prefill=config.share_prefill, record_routing=record_routing, chunks=chunks,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class BuiltRollout:
    """A built rollout engine and how weights reach it."""

    engine: PublishedRolloutEngine
    """The engine (generate, update_weights, version)."""
    publisher: WeightPublisher
    """Publishes the trainer's weights as the versions the engine serves."""
    chunks: ChunkedGeneration | None = None
    """Partial rollouts (``rollout.partial_rollouts``): the engine generates in chunks; the batch source says what
    happens between them (`ChunkedGeneration.refreshing`)."""


def build_rollout(
    config: RolloutConfig,
    model_dir: str | os.PathLike[str],
    tokenizer: Any,
    *,
    weights_root: str | os.PathLike[str] | None = None,
    seed: int = 0,
    record_routing: bool = False,
    asynchronous: bool = False,
    keep_versions: int = 2,
    in_memory_allowed: bool = True,
    actor_timeout_s: float = 300.0,
) -> BuiltRollout:
    """The rollout engine ``config`` describes for ``model_dir``, following the versions a trainer publishes under
    ``weights_root``, and its publisher.

    Args:
        config: the ``rollout:`` section.
        model_dir: the initial weights (version 0).
        tokenizer: the tokenizer the engine encodes and decodes with.
        weights_root: where disk versions go (None: an engine that is never refreshed from disk).
        seed: the engine's global seed (requests that carry their own seed do not use it).
        record_routing: record each token's MoE routing (router replay; the embedded HF engine only).
        asynchronous: the engine is driven from another thread (asynchronous rollouts): weights go through disk
            versions, of which ``keep_versions`` are kept.
        in_memory_allowed: the caller's layout allows in-memory publishing (a pipeline-parallel trainer does not).
        actor_timeout_s: placement=disaggregated: how long a weight transfer to the rollout actors may wait.

    Raises `ValueError` for an unknown engine or an option the chosen engine does not take, and `ImportError` (with
    the install command) when vLLM is asked for but not installed.
    """
    chunks = ChunkedGeneration(config.interrupt_chunk_tokens) if config.partial_rollouts else None
    if config.placement == "disaggregated":
        engine = _ray_client(
            config, model_dir, tokenizer, weights_root=weights_root, seed=seed, timeout_s=actor_timeout_s,
            asynchronous=asynchronous,
        )  # fmt: skip
    else:
        if config.sleep and config.engine == "vllm":  # vLLM allocates differently with sleep mode on
            config = dataclasses.replace(config, vllm=dataclasses.replace(config.vllm, enable_sleep_mode=True))
        engine = build_rollout_engine(
            config, model_dir, tokenizer, weights_root=weights_root, seed=seed, record_routing=record_routing,
            chunks=chunks, asynchronous=asynchronous,
        )  # fmt: skip
    in_memory = config.publish_in_memory and in_memory_allowed and not asynchronous
    receiver = engine.receiver if in_memory and isinstance(engine, ReceivesInProcess) else None
    publisher = choose_publisher(
        engine, dtype=config.dtype, weights_root=weights_root, in_process=receiver, keep_last=keep_versions
    )
    return BuiltRollout(engine=engine, publisher=publisher, chunks=chunks)


def build_rollout_engine(
    config: RolloutConfig | str,
    model_dir: str | os.PathLike[str],
    tokenizer: Any,
    *,
    weights_root: str | os.PathLike[str] | None = None,
    seed: int = 0,
    record_routing: bool = False,
    chunks: ChunkedGeneration | None = None,
    asynchronous: bool = False,
) -> PublishedRolloutEngine:
    """Only the engine of ``config.engine`` (no publisher, no placement): see `build_rollout`. ``config`` may be an
    engine's name alone (its default options). ``asynchronous`` reaches only a builder that declares it
    (`RolloutEngineBuilder`); others are called without it."""
    if isinstance(config, str):
        if ":" not in config and config not in ROLLOUT_ENGINES:
            raise ValueError(f"rollout.engine={config!r} is not one of {ROLLOUT_ENGINES.names()}")
        config = RolloutConfig(engine=config)
    if record_routing and config.engine != "hf":
        raise ValueError(
            f"router replay replays the routing the embedded HF engine records; rollout.engine={config.engine!r} "
            "does not record it yet: use rollout.engine=hf or engine.router_replay=false"
        )
    builder: RolloutEngineBuilder = ROLLOUT_ENGINES.get(config.engine)
    optional = {"asynchronous": asynchronous} if _accepts_keyword(builder, "asynchronous") else {}
    return builder(
        model_dir, tokenizer, config=config, weights_root=weights_root, seed=seed, record_routing=record_routing,
        chunks=chunks, **optional,
    )  # fmt: skip


def _accepts_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn`` declares a parameter ``name`` that may be passed by keyword (a ``**kwargs`` catch-all does
    not count: such a builder often forwards its keywords to something that would refuse an unknown one)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a readable signature (a C builtin): call it as before
        return False
    parameter = parameters.get(name)
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return parameter is not None and parameter.kind in keyword


def _ray_client(
    config: RolloutConfig,
    model_dir: str | os.PathLike[str],
    tokenizer: Any,
    *,
    weights_root: str | os.PathLike[str] | None,
    seed: int,
    timeout_s: float,
    asynchronous: bool = False,
) -> PublishedRolloutEngine:
    """placement=disaggregated: this rank's client of the rollout actors the Ray launcher started. ``asynchronous``:
    the actors load disk versions when the generator thread asks for them, since a collective send would switch
    them under the generator's requests: the vLLM server actor with ``weight_transport: auto`` -> ``disk``, the HF
    actors per call (`RayRolloutClient` with ``weights_root``)."""
    from shardforge.rollout.ray.placement import rollout_actor_names_from_env

    names = rollout_actor_names_from_env(config.num_actors)  # refuses a rank not started by --launcher ray
    if config.engine == "vllm":
        from shardforge.rollout.ray.vllm_server import RayVLLMServerEngine

        options = config.vllm
        if asynchronous and options.weight_transport == "auto":
            options = dataclasses.replace(options, weight_transport="disk")
        return RayVLLMServerEngine(
            names[0], model_dir, tokenizer, options=options, weights_root=weights_root, dtype=config.dtype,
            seed=seed, per_call_versions=asynchronous,
        )  # fmt: skip
    from shardforge.rollout.ray.hf_actor import RayRolloutClient

    if asynchronous and weights_root is None:
        raise ValueError(
            "asynchronous rollouts on the rollout actors load weight versions from disk: pass weights_root (the "
            "directory the trainer publishes to)"
        )
    return RayRolloutClient(
        names, timeout_s=timeout_s, on_actor_failure=config.on_actor_failure,
        weights_root=weights_root if asynchronous else None,
    )  # fmt: skip
