"""`ROLLOUT_ENGINES`: rollout engine builders by name (``rollout.engine``), a user's by import path.

The built-ins are registered lazily by import path, so looking a name up imports only its engine (the vLLM
builders are never imported by a run that does not ask for them). A builder has the signature of
`shardforge.rollout.factory.RolloutEngineBuilder`; register your own with
``@ROLLOUT_ENGINES.register("name")`` in a module your run imports, or name it as ``package.module:function``.
"""

from __future__ import annotations

from typing import Any

from shardforge.core.registry import Registry

__all__ = ["ROLLOUT_ENGINES"]

ROLLOUT_ENGINES: Registry[Any] = Registry("rollout engine")
ROLLOUT_ENGINES.register_lazy(
    "hf", "shardforge.rollout.factory:build_hf_engine", "embedded HF generate on the trainer's ranks (default)"
)
ROLLOUT_ENGINES.register_lazy(
    "vllm",
    "shardforge.rollout.vllm.builders:build_vllm_engine",
    "vLLM, in process (vllm.mode=in_process) or a server (vllm.mode=server)",
)
