"""The ``"vllm"`` rollout-engine builder, registered lazily in `ROLLOUT_ENGINES` by import path.

Importing this module imports ``vllm_engine.py`` (not vLLM itself: that happens in
`import_vllm`, before any model is loaded).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.config import RolloutConfig
from shardforge.rollout.factory import PublishedRolloutEngine
from shardforge.rollout.vllm.engine import VLLMRolloutEngine, import_vllm

__all__ = ["build_vllm_engine"]


def build_vllm_engine(
    model_dir: str | os.PathLike[str],
    tokenizer: Any,
    *,
    config: RolloutConfig,
    weights_root: str | os.PathLike[str] | None,
    seed: int,
    record_routing: bool,
    chunks: ChunkedGeneration | None,
    asynchronous: bool = False,
) -> PublishedRolloutEngine:
    """vLLM, in process (rollout.vllm.mode=in_process) or a server (rollout.vllm.mode=server). ``asynchronous``:
    generator threads drive the engine; a server shared by several ranks then switches versions per call (its
    ``per_call_versions``: `shardforge.rollout.server.version_gate`)."""
    options = config.vllm
    if options.mode == "server":
        from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

        if options.server_url is None and options.server_python is None:
            import_vllm()  # the server would run from this interpreter
        return VLLMServerRolloutEngine(
            model_dir, tokenizer, weights_root=weights_root, dtype=config.dtype, options=options, seed=seed,
            log_file=None if weights_root is None else Path(weights_root).parent / "vllm_server.log", chunks=chunks,
            per_call_versions=asynchronous,
        )  # fmt: skip
    import_vllm()  # fail here, with the install command, before any model is loaded
    return VLLMRolloutEngine(
        model_dir, tokenizer, weights_root=weights_root, dtype=config.dtype, options=options, seed=seed, chunks=chunks
    )
