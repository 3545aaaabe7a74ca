"""shardforge.lora: LoRA adapters on chosen Linear layers that compose with FSDP2 and tensor parallel,
PEFT-format adapter export and merged HF export.

Only `LoRAConfig` is imported eagerly; the rest on first use (PEP 562), so a config reader (the
launching `shardforge` process) does not import DTensor through ``export``/``tp``.
"""

import importlib as _importlib
import typing as _typing

from shardforge.lora.config import LoRAConfig

if _typing.TYPE_CHECKING:
    from shardforge.lora.export import (
        PEFT_PREFIX,
        lora_state_dict,
        merge_lora,
        merged_lora,
        merged_state_dict,
        save_peft_adapter,
    )
    from shardforge.lora.layer import LoRALinear, apply_lora, lora_modules, reset_lora_parameters
    from shardforge.lora.tp import AdapterParallel, LoRAParallel, adapter_tp_styles, lora_tp_plan

__version__ = "0.1.0"

_LAZY = {
    **dict.fromkeys(
        ("PEFT_PREFIX", "lora_state_dict", "merge_lora", "merged_lora", "merged_state_dict", "save_peft_adapter"),
        "shardforge.lora.export",
    ),
    **dict.fromkeys(("LoRALinear", "apply_lora", "lora_modules", "reset_lora_parameters"), "shardforge.lora.layer"),
    **dict.fromkeys(("AdapterParallel", "LoRAParallel", "adapter_tp_styles", "lora_tp_plan"), "shardforge.lora.tp"),
}

__all__ = [
    "PEFT_PREFIX",
    "AdapterParallel",
    "LoRAConfig",
    "LoRALinear",
    "LoRAParallel",
    "adapter_tp_styles",
    "apply_lora",
    "lora_modules",
    "lora_state_dict",
    "lora_tp_plan",
    "merge_lora",
    "merged_lora",
    "merged_state_dict",
    "reset_lora_parameters",
    "save_peft_adapter",
]


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
