"""The per-sequence extras that carry a vision-language batch's images (`image_extras`), from any object with
a sequence's ``pixel_values`` and ``image_grid_thw`` (`ImagesLike`: the rollout package's ``ImageInputs``, a VLM
SFT example).

Written by `shardforge.algorithms.data.vlm.pack_vlm_examples` (SFT) and
`shardforge.rollout.workflows.trajectories_to_batch` (RL), read by the engine's
`shardforge.engine.vision.VisionLMHead`. Both extras are per-sequence ([N, ...]), zero-padded
to the batch's largest sequence, so `PackedBatch.select` (micro-batching) keeps each sequence's images
with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["VLM_GRIDS", "VLM_PIXELS", "ImagesLike", "image_extras"]

VLM_PIXELS = "pixel_values"
"""[N, max patches, patch dim] pixel values of each sequence's images, in order, zero-padded."""
VLM_GRIDS = "image_grid_thw"
"""[N, max images, 3] (t, h, w) patch grids of each sequence's images; zero rows = no image."""


class ImagesLike(Protocol):
    """The images of one sequence: ``pixel_values`` [patches, dim], ``image_grid_thw`` [images, 3] (t, h, w)."""

    @property
    def pixel_values(self) -> torch.Tensor: ...

    @property
    def image_grid_thw(self) -> torch.Tensor: ...


def image_extras(images: Sequence[ImagesLike | None]) -> dict[str, torch.Tensor]:
    """``{VLM_PIXELS: [N, max patches, dim], VLM_GRIDS: [N, max images, 3]}`` for N sequences (None or an
    empty one: a sequence without images, all zeros)."""
    present = [i for i in images if i is not None and i.pixel_values.numel()]
    dim = max((i.pixel_values.shape[1] for i in present), default=1)
    max_patches = max((i.pixel_values.shape[0] for i in present), default=1)
    max_images = max((int(i.image_grid_thw.shape[0]) for i in present), default=1)
    pixels = torch.zeros(len(images), max_patches, dim)
    grids = torch.zeros(len(images), max_images, 3, dtype=torch.long)
    for n, inputs in enumerate(images):
        if inputs is not None and inputs.pixel_values.numel():
            pixels[n, : inputs.pixel_values.shape[0]] = inputs.pixel_values
            grids[n, : inputs.image_grid_thw.shape[0]] = inputs.image_grid_thw
    return {VLM_PIXELS: pixels, VLM_GRIDS: grids}
