"""The RL trainers' prompts (GRPO, PPO, distill): ``train_file``/``eval_file`` or ``data:`` sources with
column mapping and weighted mixtures (docs/packages/algorithms-data.md), loaded the same way as every
trainer's (`shardforge.algorithms.data.source_set`).

A step's prompts are drawn by `PromptData.sampler` (seeded; dynamic sampling's backfill rounds use
other seeds). The draws are a function of (seed, step) alone, so a resumed run (and the asynchronous
generator thread, which runs ahead) replays them exactly; for a mixture that means the weights must not
change on resume, so they are part of `PromptData.data_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardforge.algorithms.data.config import apply_chat_template_override, eval_source, train_sources
from shardforge.algorithms.data.source_set import IndexSampler, batch_sampler, loader_arg
from shardforge.algorithms.data.sources import SourceConfig
from shardforge.algorithms.rlvr import PromptSet, load_prompts

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
    tokenizer's template (what the chat workflows render with)."""
    apply_chat_template_override(tokenizer, config.data.chat_template)

    sources = train_sources(config)
    if not sources:
        raise ValueError("no training prompts: set train_file, data.train or data.mix")
    per_source = [load_prompts(loader_arg(s), tokenizer, max_prompt_len=config.max_prompt_len) for s in sources]
    prompts = PromptSet(
        [t for p in per_source for t in p.texts],
        [r for p in per_source for r in p.references],
        [i for p in per_source for i in p.ids],
    )
    held = eval_source(config)
    return PromptData(
        prompts=prompts,
        held_out=load_prompts(loader_arg(held), tokenizer) if held is not None else None,
        sources=tuple(sources),
        sizes=tuple(len(p) for p in per_source),
        mix=bool(config.data.mix),
    )
