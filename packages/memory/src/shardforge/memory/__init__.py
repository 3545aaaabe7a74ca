"""Memory savers: AnyPrecisionAdamW and a sequence-tiled MLP."""

from shardforge.memory.anyprecision import AnyPrecisionAdamW

__version__ = "0.1.0"

__all__ = ["AnyPrecisionAdamW"]
