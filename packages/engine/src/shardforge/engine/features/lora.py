"""LoRA in the engine (``EngineConfig.lora``): where adapters are added, placed and exported.

- Build: adapters are added to the rank-0 reference model (initialised there with ``config.seed``)
  and to the meta-device model *before* tensor parallelism, so the broadcast full state dict that
  fills the sharded model carries the adapters' initial values like any other weight, and every layout
  starts from the same adapters. TP uses the family plan passed through `lora_tp_plan` (adapters follow
  their parent Linear, frozen params stay frozen); FSDP2 shards each decoder layer's frozen base weights
  and trainable adapters in one unit.
- Train: only adapters have ``requires_grad``, so the optimizer, gradient clipping and gradient
  reduce-scatters only see them.
- Checkpoints: `TrainState(trainable_only=True)`: adapters and their optimizer state only; the base is
  re-read from the model path when the engine is built again.
- Export: `export_lora` writes a PEFT adapter; ``export_hf``, ``full_state_dict`` and ``publish_weights``
  run inside `merged_lora`, so they see plain HF names holding ``W + scaling * B @ A``.

Limits: pp > 1 and value heads are refused (see `shardforge.engine.checks`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from torch import nn

from shardforge.lora import apply_lora, lora_tp_plan, merged_lora, save_peft_adapter

__all__ = ["add_adapters", "export_lora", "merged_weights", "tp_plan"]


def add_adapters(model: nn.Module, config: Any) -> None:
    """Apply ``config.lora`` (if any) to ``model`` (reference or meta), adapters seeded with ``config.seed``."""
    if config.lora is not None:
        apply_lora(model, config.lora, seed=config.seed)


def tp_plan(model: nn.Module, plan: Any, config: Any) -> Any:
    """The TP plan to use: unchanged without LoRA; with it, the family plan made adapter-aware."""
    if config.lora is None:
        return plan
    if plan is None:
        from shardforge.tensor_parallel import plan_for_model

        plan = plan_for_model(model, sequence_parallel=config.sequence_parallel)
    return lora_tp_plan(plan)


def merged_weights(model: nn.Module, config: Any) -> contextlib.AbstractContextManager[Any]:
    """A context in which ``model`` shows merged HF weights (a no-op without LoRA)."""
    return merged_lora(model) if config.lora is not None else contextlib.nullcontext(model)


def export_lora(
    model: nn.Module,
    config: Any,
    hf_config: Any,
    out_dir: str | os.PathLike[str],
    base_model_name_or_path: str | None = None,
) -> None:
    """Write the model's adapters in PEFT format (collective; rank 0 writes). The base model recorded is
    ``config.lora.base_model_name_or_path`` as given when set; otherwise ``base_model_name_or_path`` or the one
    the engine was built from (``hf_config._name_or_path``), a local one as an absolute path
    (``AutoPeftModelForCausalLM.from_pretrained`` resolves it from any cwd)."""
    if config.lora is None:
        raise ValueError("export_lora needs an engine built with engine.lora set (e.g. engine.lora.r=8)")
    if config.lora.base_model_name_or_path:
        save_peft_adapter(model, out_dir, config.lora, base_model_name_or_path=config.lora.base_model_name_or_path)
        return
    base = base_model_name_or_path or getattr(hf_config, "_name_or_path", None) or None
    if base and Path(base).exists():  # a local base: absolute, so the adapter loads from any directory
        base = str(Path(base).resolve())
    save_peft_adapter(model, out_dir, config.lora, base_model_name_or_path=base)
