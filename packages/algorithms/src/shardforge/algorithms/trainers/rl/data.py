"""The RL trainers' prompts (GRPO, PPO, distill): ``train_file``/``eval_file`` or ``data:`` sources with
column mapping and weighted mixtures (docs/packages/algorithms-data.md), loaded the same way as every
trainer's (`shardforge.algorithms.data.source_set`).

A step's prompts are drawn by `PromptData.sampler` (seeded; dynamic sampling's backfill rounds use
other seeds). The draws are a function of (seed, step) alone, so a resumed run (and the asynchronous
generator thread, which runs ahead) replays them exactly; for a mixture that means the weights must not
change on resume, so they are part of `PromptData.data_state`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardforge.algorithms.data.config import apply_chat_template_override, eval_source, train_sources
from shardforge.algorithms.data.prompts import load_image_prompts, load_prompts
from shardforge.algorithms.data.rows import ImageRows, image_rows
from shardforge.algorithms.data.source_set import IndexSampler, batch_sampler, loader_arg
from shardforge.algorithms.data.sources import SourceConfig
from shardforge.rollout.types import PromptSet

__all__ = ["PromptData", "load_prompt_data"]


@dataclass(frozen=True, slots=True)
class PromptData:
    """The training prompts (all sources, concatenated), the held-out ones, and how steps draw prompts."""

    prompts: PromptSet
    held_out: PromptSet | None
    sources: tuple[SourceConfig, ...]
    sizes: tuple[int, ...]
    """Prompts kept per source (after max_prompt_len), in the order of ``prompts``."""
    mix: bool
    image_processor: Any = None
    """A vision-language model's image processor (None: text prompts); saved next to the HF export."""

    def sampler(self, prompts_per_step: int, seed: int) -> IndexSampler:
        """Global batches of ``prompts_per_step`` prompt indices (a weighted mixture when ``mix``)."""
        return batch_sampler(self.sources, self.sizes, prompts_per_step, seed=seed, mix=self.mix)

    def data_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"num_prompts": len(self.prompts)}
        if self.mix:
            state["mixture_sources"] = {s.label: [n, s.weight] for s, n in zip(self.sources, self.sizes)}
        return state


def load_prompt_data(config: Any, tokenizer: Any) -> PromptData:
    """Read the training and held-out prompts of an RL trainer config; ``data.chat_template`` replaces the
    tokenizer's template (what the chat workflows render with). A vision-language ``model`` (its config has
    a vision tower) reads chat rows with image parts (`rlvr.load_image_prompts`), any other prompt/completion
    rows (`rlvr.load_prompts`)."""
    apply_chat_template_override(tokenizer, config.data.chat_template)

    sources = train_sources(config)
    if not sources:
        raise ValueError("no training prompts: set train_file, data.train or data.mix")
    images = image_rows(config.model, tokenizer, getattr(config, "tokenizer", None))
    load = _prompt_loader(images, tokenizer)
    per_source = [load(loader_arg(s), config.max_prompt_len) for s in sources]
    held = eval_source(config)
    return PromptData(
        prompts=PromptSet.concat(per_source),
        held_out=load(loader_arg(held), None) if held is not None else None,
        sources=tuple(sources),
        sizes=tuple(len(p) for p in per_source),
        mix=bool(config.data.mix),
        image_processor=images.image_processor if images is not None else None,
    )


def _prompt_loader(images: ImageRows | None, tokenizer: Any) -> Callable[[Any, int | None], PromptSet]:
    """(source, max_prompt_len) -> `PromptSet`: image chat rows for a vision-language model, else text rows."""
    if images is None:
        return lambda source, max_len: load_prompts(source, tokenizer, max_prompt_len=max_len)
    processor, token = images.image_processor, images.image_token
    return lambda source, max_len: load_image_prompts(
        source, tokenizer, processor, image_token=token, max_prompt_len=max_len
    )
