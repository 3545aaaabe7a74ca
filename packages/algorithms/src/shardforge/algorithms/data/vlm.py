"""Vision-language SFT data: chat rows with image content parts -> token ids, loss masks and visual inputs.

A row is an HF chat with image parts, one or several images per row:

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "path/to.png"},
                                                {"type": "text", "text": "colour?"}]},
                  {"role": "assistant", "content": "red"}]}

The chat template renders each image part as one image token (Qwen2.5-VL: ``<|vision_start|><|image_pad|>
<|vision_end|>``); the image processor turns the images into ``pixel_values`` [patches, C*t*p*p] and
``image_grid_thw`` [images, 3], and each image token is expanded to ``t*h*w / merge_size**2`` copies (what
the HF processor does), so the vision tower's output fills them one to one. Loss is on assistant tokens.

Packed batches carry the visual inputs as per-sequence extras (zero-padded to the batch's largest
sequence, so `PackedBatch.select` and micro-batching keep each sequence's images with it):
``VLM_PIXELS`` [N, max patches, C*t*p*p] and ``VLM_GRIDS`` [N, max images, 3] (rows of zeros = no image).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.algorithms.data.sources import SourceConfig, read_rows
from shardforge.engine.batching import PackedBatch, pack_sequences
from shardforge.engine.batching.visual import VLM_GRIDS, VLM_PIXELS, image_extras

__all__ = [
    "VLM_GRIDS",
    "VLM_PIXELS",
    "VLMExample",
    "encode_vlm_prompt",
    "load_image_processor",
    "load_vlm_examples",
    "pack_vlm_examples",
    "tokenize_vlm_row",
]


@dataclass(frozen=True, slots=True)
class VLMExample:
    """One tokenised image+text example."""

    input_ids: list[int]
    loss_mask: list[float]
    pixel_values: torch.Tensor
    """[patches, patch dim] of all images of the example, in order (0 rows without images)."""
    image_grid_thw: torch.Tensor
    """[images, 3] int64."""


def _image_parts(messages: list[dict[str, Any]], where: str) -> list[str]:
    paths = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    image = part.get("image")
                    if not isinstance(image, str):
                        raise ValueError(f"{where}: message {i} has an image part without an 'image' path: {part!r}")
                    paths.append(image)
    return paths


def _load_images(paths: list[str], base: Path | None, where: str) -> list[Any]:
    from PIL import Image

    images = []
    for raw in paths:
        path = Path(raw)
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise FileNotFoundError(
                f"{where}: image {raw!r} not found (looked at {str(path)!r}); image parts name local files, "
                "absolute or relative to the data file's directory"
            )
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except OSError as exc:  # PIL.UnidentifiedImageError is an OSError
            raise ValueError(f"{where}: {str(path)!r} is not an image Pillow can read ({exc})") from exc
    return images


def _expand(text: str, image_token: str, counts: list[int], where: str) -> str:
    pieces = text.split(image_token)
    if len(pieces) - 1 > len(counts):
        raise ValueError(f"{where}: the chat template rendered {len(pieces) - 1} image tokens for {len(counts)} images")
    out = [pieces[0]]
    for count, piece in zip(counts, pieces[1:]):
        out += [image_token * count, piece]
    return "".join(out)


def _visual_inputs(
    messages: list[dict[str, Any]], image_processor: Any, base: Path | None, where: str
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Pixel values [patches, dim], grids [images, 3] and image-token counts of the messages' images."""
    paths = _image_parts(messages, where)
    if not paths:
        return torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long), []
    visual = image_processor(images=_load_images(paths, base, where), return_tensors="pt")
    pixels, grids = visual["pixel_values"].float(), visual["image_grid_thw"].long()
    merge = int(getattr(image_processor, "merge_size", 2))
    return pixels, grids, [int(g.prod()) // merge**2 for g in grids]


def encode_vlm_prompt(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    image_processor: Any,
    *,
    image_token: str,
    where: str = "prompt",
    base: Path | None = None,
) -> VLMExample:
    """A generation prompt: ``messages`` rendered with the generation prompt, image tokens expanded, and
    their visual inputs (loss mask all 0). Feed ``input_ids``, ``pixel_values`` and ``image_grid_thw`` to
    an HF ``generate`` (the ids are what training saw before the assistant's tokens)."""
    pixels, grids, counts = _visual_inputs(messages, image_processor, base, where)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(_expand(text, image_token, counts, where), add_special_tokens=False)["input_ids"])
    return VLMExample(ids, [0.0] * len(ids), pixels, grids)


def tokenize_vlm_row(
    row: dict[str, Any],
    tokenizer: Any,
    image_processor: Any,
    *,
    image_token: str,
    where: str = "row",
    base: Path | None = None,
) -> VLMExample:
    """Tokenise one image+text chat row (loss on assistant turns); a `ValueError` names a malformed row."""
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{where}: image chat rows need a tokenizer with a chat_template")
    pixels, grids, counts = _visual_inputs(messages, image_processor, base, where)

    def ids_of(prefix: list[dict[str, Any]], generation: bool) -> list[int]:
        text = tokenizer.apply_chat_template(prefix, add_generation_prompt=generation, tokenize=False)
        text = _expand(text, image_token, counts, where)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    ids: list[int] = []
    mask: list[float] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, after = ids_of(messages[:i], True), ids_of(messages[: i + 1], False)
        if after[: len(before)] != before or before[: len(ids)] != ids:
            raise ValueError(f"{where}: the chat template is not prefix-stable; cannot locate assistant tokens")
        mask += [0.0] * (len(before) - len(ids)) + [1.0] * (len(after) - len(before))
        ids = after
    if not any(mask):
        raise ValueError(f"{where}: no assistant message, so there is nothing to train on")
    image_id = tokenizer.convert_tokens_to_ids(image_token)
    if sum(1 for t in ids if t == image_id) != sum(counts):
        raise ValueError(f"{where}: images after the last assistant turn are not supported (nothing attends to them)")
    return VLMExample(ids, mask, pixels, grids)


def load_vlm_examples(
    path: str | Path | SourceConfig,
    tokenizer: Any,
    image_processor: Any,
    *,
    image_token: str,
    max_seq_len: int | None = None,
) -> list[VLMExample]:
    """Read and tokenise a JSONL file (or a `SourceConfig`) of image+text chat rows. Image paths are local
    files; relative ones resolve against the data file's directory (a non-file source: the working
    directory). ``max_seq_len`` truncates text after the last image token; a cut through an image is a
    `ValueError` (the vision tower's outputs must fill every image token)."""
    rows, label, sep = read_rows(path, "dataset file", (("messages",),))
    where_file = Path(path.source) if isinstance(path, SourceConfig) else Path(path)
    base = where_file.parent if where_file.is_file() else None
    image_id = tokenizer.convert_tokens_to_ids(image_token)
    examples = []
    for n, row in rows:
        where = f"{label}{sep}{n}"
        example = tokenize_vlm_row(row, tokenizer, image_processor, image_token=image_token, where=where, base=base)
        if max_seq_len is not None and len(example.input_ids) > max_seq_len:
            example = _truncated(example, max_seq_len, image_id, where)
        examples.append(example)
    return examples


def _truncated(example: VLMExample, max_seq_len: int, image_id: int, where: str) -> VLMExample:
    ids = example.input_ids
    last_image = max((i for i, t in enumerate(ids) if t == image_id), default=-1)
    if last_image >= max_seq_len:
        raise ValueError(
            f"{where}: max_seq_len={max_seq_len} would cut through an image (its last image token is at "
            f"position {last_image}, the row has {len(ids)} tokens); raise max_seq_len to >= {len(ids)} or "
            "use smaller images (the image processor's max_pixels)"
        )
    mask = example.loss_mask[:max_seq_len]
    if not any(mask):
        raise ValueError(
            f"{where}: max_seq_len={max_seq_len} removes every assistant token of this row ({len(ids)} tokens); "
            f"raise max_seq_len to >= {len(ids)}"
        )
    return VLMExample(ids[:max_seq_len], mask, example.pixel_values, example.image_grid_thw)


def load_image_processor(model: str | Path, model_type: str | None = None) -> Any:
    """The image processor saved next to a vision-language model (``preprocessor_config.json``); a
    missing one is a `FileNotFoundError` that says what to add."""
    from transformers import AutoImageProcessor

    path = Path(model)
    if not (path / "preprocessor_config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} holds a vision-language model ({model_type}) but no preprocessor_config.json; save the "
            "model's image processor there (`image_processor.save_pretrained(dir)`) or set tokenizer: to a "
            "directory that has both the tokenizer and preprocessor_config.json"
        )
    return AutoImageProcessor.from_pretrained(str(path))


def pack_vlm_examples(examples: list[VLMExample], indices: list[int]) -> PackedBatch:
    """Pack the examples at ``indices`` into one `PackedBatch` with ``VLM_PIXELS`` / ``VLM_GRIDS`` extras."""
    chosen = [examples[i] for i in indices]
    batch = pack_sequences([e.input_ids for e in chosen], [e.loss_mask for e in chosen])
    batch.extras.update(image_extras(chosen))
    return batch
