"""shardforge.checkpoint_dcp: resumable, reshardable, crash-safe checkpoints with
torch.distributed.checkpoint, and streaming HF safetensors import/export."""

from shardforge.checkpoint_dcp.checkpointer import COMMIT_MARKER, AsyncMode, Checkpointer
from shardforge.checkpoint_dcp.convert import convert_dcp_to_hf
from shardforge.checkpoint_dcp.hf import export_hf, load_hf, write_hf_dir, write_safetensors_shards
from shardforge.checkpoint_dcp.state import TrainableState, TrainState, capture_rng_state, restore_rng_state
from shardforge.checkpoint_dcp.validate import (
    CorruptCheckpointError,
    check_compatible,
    checkpoint_tensor_shapes,
    verify_files,
)

__version__ = "0.1.0"

__all__ = [
    "COMMIT_MARKER",
    "AsyncMode",
    "Checkpointer",
    "CorruptCheckpointError",
    "TrainState",
    "TrainableState",
    "capture_rng_state",
    "check_compatible",
    "checkpoint_tensor_shapes",
    "convert_dcp_to_hf",
    "export_hf",
    "load_hf",
    "restore_rng_state",
    "verify_files",
    "write_hf_dir",
    "write_safetensors_shards",
]
