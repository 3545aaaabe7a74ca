"""Names of the per-sequence extras that carry a vision-language batch's images.

Written by `shardforge.algorithms.data.vlm.pack_vlm_examples`, read by the engine's
`shardforge.algorithms.engine.vision.VisionLMHead`. Both are per-sequence ([N, ...]) extras, zero-padded
to the batch's largest sequence, so `PackedBatch.select` (micro-batching) keeps each sequence's images
with it.
"""

from __future__ import annotations

__all__ = ["VLM_GRIDS", "VLM_PIXELS"]

VLM_PIXELS = "pixel_values"
"""[N, max patches, patch dim] pixel values of each sequence's images, in order, zero-padded."""
VLM_GRIDS = "image_grid_thw"
"""[N, max images, 3] (t, h, w) patch grids of each sequence's images; zero rows = no image."""
