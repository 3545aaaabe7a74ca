"""shardforge.lora: LoRA adapters on chosen Linear layers that compose with FSDP2 and tensor parallel,
PEFT-format adapter export and merged HF export."""

from shardforge.lora.config import LoRAConfig
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
