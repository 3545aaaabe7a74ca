"""Inputs and outputs of the embedded HF engine's ``generate`` beyond token ids: a vision-language model's
visual inputs per batch, and router replay's experts per row (`rollout.hf_engine.HFRolloutEngine`)."""

from __future__ import annotations

import torch

from shardforge.rollout.types import ImageInputs

__all__ = ["routed_per_row", "visual_kwargs"]


def visual_kwargs(
    input_ids: torch.Tensor, images: list[ImageInputs | None], image_token_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """``generate``'s visual inputs for a batch of (left-padded) rows. ``mm_token_type_ids`` (1 at image
    tokens, what the HF processor returns): without it transformers 5 gives the image tokens 1-D text
    positions instead of the 3-D ones that training uses (`engine.vision.mrope_position_ids`)."""
    present = [i for i in images if i is not None]
    return {
        "pixel_values": torch.cat([i.pixel_values for i in present]).to(device),
        "image_grid_thw": torch.cat([i.image_grid_thw for i in present]).to(device),
        "mm_token_type_ids": (input_ids == image_token_id).int().to(device),
    }


def routed_per_row(
    routed: list[list[torch.Tensor]], rows: list[tuple[int, list[int]]], width: int, steps: int
) -> list[torch.Tensor]:
    """Per generate row, ``[width_of_its_prompt + steps, L, K]`` int16 experts from the router calls of one
    cached ``generate``: call 0 is the prefill (``B * width`` rows, prompts left-padded), call ``s >= 1``
    feeds generated token ``s - 1`` (``B`` rows). The last generated token is never fed: -1."""
    top_k = routed[0][0].shape[-1]
    prefill = torch.stack([calls[0].view(len(rows), width, top_k) for calls in routed], dim=2)  # [B, width, L, K]
    decode = torch.full((len(rows), steps, len(routed), top_k), -1, dtype=torch.int64)
    for s in range(1, len(routed[0])):
        decode[:, s - 1] = torch.stack([calls[s].view(len(rows), top_k) for calls in routed], dim=1)
    out = []
    for b, (_, prompt) in enumerate(rows):
        out.append(torch.cat([prefill[b, width - len(prompt) :], decode[b]]).to(torch.int16))
    return out
