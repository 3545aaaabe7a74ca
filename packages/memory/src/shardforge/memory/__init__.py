"""Memory savers: AnyPrecisionAdamW and a sequence-tiled MLP."""

__all__: list[str] = []
