"""A trained reward model in the RL loop: a forward-only value-head engine scores every rollout.

.. code-block:: yaml

    reward_model:
      path: out/rm/hf        # `shardforge train rm`'s export (a token-classification model, 1 label)
      weight: 1.0            # reward = verifier reward(s) + weight * RM score
      offload: true          # weights on the host except during the scoring forward

The engine is built on the trainer's layout (FSDP/TP/CP shard it like the policy) and scores each
rank's own trajectories: the value at a trajectory's last token, as `shardforge train rm` trains it.
The forward is collective, so scoring runs in the training step on every rank (after sampling,
before advantages): also under async rollouts, where the batch was generated on another thread.
Verifier rewards, ``rewards:`` terms and ``reward_shaping`` apply first; dynamic sampling (which
filters on rewards while sampling) cannot see the RM score and is refused with a reward model.
Metrics: ``reward_model/score_mean``, ``reward_model/score_std`` (global over data-parallel ranks).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardforge.engine import EngineConfig
from shardforge.engine.batching import pack_sequences
from shardforge.engine.objectives.bradley_terry import last_token_scores
from shardforge.mesh.collectives import all_reduce_sum

if TYPE_CHECKING:  # imported where built: the launching process reads the config without the engine
    pass

__all__ = ["RewardModelConfig", "RewardModelScorer", "check_reward_model_dir"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardModelConfig:
    """The ``reward_model:`` key of the RL trainers (off while ``path`` is None)."""

    path: str | None = None
    """HF directory of a trained reward model (`shardforge train rm`'s ``hf/`` export); None = no reward model."""
    weight: float = 1.0
    """reward = verifier/``rewards:`` reward + weight * RM score."""
    offload: bool = True
    """Keep its weights in host memory except during its forward (offload_when_idle)."""

    def __post_init__(self) -> None:
        if self.path is not None and self.weight == 0:
            raise ValueError("reward_model.weight=0 would build a reward model that changes nothing; drop reward_model")


def check_reward_model_dir(path: str) -> None:
    """Refuse a directory that is not a reward model (no config, or no trained ``score`` head)."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"reward_model.path={path!r} is not an HF model directory (no config.json)")
    keys = _weight_names(root)
    if keys is not None and not any(k == "score.weight" or k.endswith(".score.weight") for k in keys):
        raise ValueError(
            f"reward_model.path={path!r} has no reward head (score.weight): a causal LM would score with a random "
            "head. Give the hf/ export of `shardforge train rm` (or another 1-label token-classification model)"
        )


def _weight_names(root: Path) -> list[str] | None:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    single = root / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return list(handle.keys())
    return None  # another format: let the loader decide


class RewardModelScorer:
    """Scores trajectories with a frozen value-head engine on the trainer's layout (collective)."""

    def __init__(self, config: RewardModelConfig, layout: Any, engine_config: EngineConfig, vocab_size: int) -> None:
        assert config.path is not None
        check_reward_model_dir(config.path)
        rm_config = dataclasses.replace(engine_config, head="value", lora=None)
        if config.offload:
            rm_config = dataclasses.replace(rm_config, offload_when_idle=True, cpu_offload=False)
        self.config = config
        from shardforge.engine import TrainEngine

        self.engine = TrainEngine(config.path, layout, rm_config)
        if self.engine.hf_config.vocab_size != vocab_size:
            raise ValueError(
                f"reward_model.path={config.path!r} has vocab_size {self.engine.hf_config.vocab_size} but the policy "
                f"has {vocab_size}: the reward model must use the policy's tokenizer"
            )

    def scores(self, trajectories: list[Any]) -> torch.Tensor:
        """[N] float32 RM scores of this rank's trajectories (every rank must call, same number of times)."""
        batch = pack_sequences(
            [list(t.token_ids) for t in trajectories], [[1.0] * len(t.token_ids) for t in trajectories]
        )
        values = self.engine.forward(batch)
        return last_token_scores(values, batch.cu_seqlens).float()

    def add_scores(self, rewards: torch.Tensor, trajectories: list[Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """``rewards + weight * score`` and the global score mean/std."""
        scores = self.scores(trajectories)
        total, square, count = all_reduce_sum(
            float(scores.double().sum()), float((scores.double() ** 2).sum()), float(scores.numel()),
            group=self.engine.dp_group, device=self.engine.device,
        )  # fmt: skip
        mean = total / max(count, 1.0)
        std = max(square / max(count, 1.0) - mean * mean, 0.0) ** 0.5
        stats = {"reward_model/score_mean": mean, "reward_model/score_std": std}
        return rewards + self.config.weight * scores.to(rewards.dtype), stats
