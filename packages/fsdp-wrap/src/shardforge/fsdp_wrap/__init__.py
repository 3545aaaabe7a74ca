"""shardforge.fsdp_wrap: FSDP2 sharding, DDP replication, meta-device init, grad clipping and activation checkpointing."""

from shardforge.fsdp_wrap.checkpointing import apply_activation_checkpointing
from shardforge.fsdp_wrap.clip import clip_grad_norm_, total_grad_norm
from shardforge.fsdp_wrap.config import ActivationCheckpointConfig, FSDPConfig
from shardforge.fsdp_wrap.meta_init import load_full_state_dict
from shardforge.fsdp_wrap.replicate import apply_replicate
from shardforge.fsdp_wrap.wrap import apply_fsdp, offload_policy

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointConfig",
    "FSDPConfig",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "apply_replicate",
    "clip_grad_norm_",
    "load_full_state_dict",
    "offload_policy",
    "total_grad_norm",
]
