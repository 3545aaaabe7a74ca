"""How a trainer reads and packs its rows, chosen by the model: a text model's prompt/completion and chat rows
(`TextRows`), or a vision-language model's chat rows with image content parts (`ImageRows`: its image processor
and image token; docs/packages/algorithms-vlm.md). The SFT trainer packs them; the RL trainers read their image
prompts with `image_rows`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from shardforge.algorithms.data.sft import load_sft_examples, pack_examples
from shardforge.algorithms.data.sources import SourceConfig
from shardforge.engine.batching import PackedBatch
from shardforge.engine.loading import is_vlm, load_hf_config

__all__ = ["ImageRows", "SFTRows", "TextRows", "image_rows", "sft_rows"]


class SFTRows(Protocol):
    """How the SFT trainer reads and packs its rows (text or image+text): one object, chosen by the model."""

    def load(self, source: str | SourceConfig, tokenizer: Any, max_seq_len: int | None) -> list[Any]:
        """Tokenised examples (with ``input_ids`` and ``loss_mask``) of one source."""
        ...

    def pack(self, examples: list[Any], indices: list[int]) -> PackedBatch:
        """The examples at ``indices`` as one packed batch."""
        ...

    def export(self, hf_dir: Path) -> None:
        """Write what else a plain HF user needs next to the exported model (main rank)."""
        ...


class TextRows:
    """prompt/completion and chat rows of a text model."""

    def load(self, source: str | SourceConfig, tokenizer: Any, max_seq_len: int | None) -> list[Any]:
        return load_sft_examples(source, tokenizer, max_seq_len=max_seq_len)

    def pack(self, examples: list[Any], indices: list[int]) -> PackedBatch:
        return pack_examples(examples, indices)

    def export(self, hf_dir: Path) -> None:
        pass


class ImageRows:
    """Chat rows with image content parts, for a vision-language model (`data.vlm`)."""

    def __init__(self, image_processor: Any, image_token: str) -> None:
        self.image_processor = image_processor
        self.image_token = image_token

    def load(self, source: str | SourceConfig, tokenizer: Any, max_seq_len: int | None) -> list[Any]:
        from shardforge.algorithms.data.vlm import load_vlm_examples

        return load_vlm_examples(
            source, tokenizer, self.image_processor, image_token=self.image_token, max_seq_len=max_seq_len
        )

    def pack(self, examples: list[Any], indices: list[int]) -> PackedBatch:
        from shardforge.algorithms.data.vlm import pack_vlm_examples

        return pack_vlm_examples(examples, indices)

    def export(self, hf_dir: Path) -> None:
        self.image_processor.save_pretrained(str(hf_dir))  # AutoImageProcessor.from_pretrained(hf_dir)


def sft_rows(model: str, tokenizer: Any, processor_dir: str | None = None) -> SFTRows:
    """`ImageRows` when ``model``'s config has a vision tower, else `TextRows` (see `image_rows`)."""
    return image_rows(model, tokenizer, processor_dir) or TextRows()


def image_rows(model: str, tokenizer: Any, processor_dir: str | None = None) -> ImageRows | None:
    """`ImageRows` (the image processor and image token) when ``model``'s config has a vision tower, else
    None. The image processor is read from ``processor_dir`` (the tokenizer directory) when it has one,
    else from the model directory; the SFT and RL trainers read their image rows with it."""
    hf_config = load_hf_config(model)
    if not is_vlm(hf_config):
        return None
    from shardforge.algorithms.data.vlm import load_image_processor

    image_id = getattr(hf_config, "image_token_id", None)
    token = tokenizer.convert_ids_to_tokens(image_id) if isinstance(image_id, int) else None
    if not isinstance(token, str) or tokenizer.convert_tokens_to_ids(token) != image_id:
        raise ValueError(
            f"{model!r} is a vision-language model whose image_token_id={image_id} is not a token of its "
            f"tokenizer (vocabulary size {len(tokenizer)}); use the tokenizer saved with the model"
        )
    source = processor_dir if processor_dir and (Path(processor_dir) / "preprocessor_config.json").is_file() else model
    return ImageRows(load_image_processor(source, hf_config.model_type), token)
