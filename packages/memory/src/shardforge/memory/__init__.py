"""Memory savers: AnyPrecisionAdamW and a sequence-tiled MLP."""

from shardforge.memory.anyprecision import AnyPrecisionAdamW
from shardforge.memory.tiled_mlp import apply_tiled_mlp

__version__ = "0.1.0"

__all__ = ["AnyPrecisionAdamW", "apply_tiled_mlp"]
