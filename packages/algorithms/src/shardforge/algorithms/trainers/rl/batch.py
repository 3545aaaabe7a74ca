"""Trajectories -> the engine's packed batch: where the rollout package's output becomes training input.

The rollout package knows nothing of the engine (DESIGN.md section 2); this is the one place that turns its
token-in/token-out `Trajectory` s into a `PackedBatch` with the RL extras the objectives read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardforge.engine.batching import PackedBatch, pack_sequences
from shardforge.engine.batching.visual import image_extras
from shardforge.engine.features.router_replay import ROUTED_EXPERTS
from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS
from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
from shardforge.rollout.episodes.trajectory import Trajectory

__all__ = ["trajectories_to_batch"]


def trajectories_to_batch(trajectories: Sequence[Trajectory], advantages: torch.Tensor) -> PackedBatch:
    """Pack trajectories; the loss mask is each trajectory's (model tokens only).

    Extras ([T], on the masked tokens, 0 elsewhere): ``advantages`` (the trajectory's advantage),
    ``old_logprobs`` and ``behaviour_logprobs`` (both the rollout engine's log-probs; a trainer may
    overwrite ``old_logprobs`` with recomputed ones). Tool output, user turns and template markers
    have mask 0: no advantage, no loss, no KL, no value target. Trajectories of image prompts add the
    per-sequence image extras (`batching.visual.image_extras`), so every forward (old, reference,
    current log-probs) sees each sequence's images.
    """
    if len(trajectories) != advantages.numel():
        raise ValueError(f"{len(trajectories)} trajectories but {advantages.numel()} advantages")
    batch = pack_sequences([t.token_ids for t in trajectories], [[float(m) for m in t.loss_mask] for t in trajectories])
    adv = torch.zeros(batch.num_tokens)
    behaviour = torch.zeros(batch.num_tokens)
    bounds = batch.cu_seqlens.tolist()
    for i, t in enumerate(trajectories):
        start, end = bounds[i], bounds[i] + len(t.token_ids)
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        adv[start:end] = torch.where(mask, float(advantages[i]), 0.0)
        behaviour[start:end] = torch.where(mask, torch.tensor(t.logprobs, dtype=torch.float32), 0.0)
    batch.extras = {ADVANTAGES: adv, OLD_LOGPROBS: behaviour.clone(), BEHAVIOUR_LOGPROBS: behaviour}
    routed = [t.routed_experts for t in trajectories]
    if any(r is not None for r in routed):  # MoE router replay: [T, L, K], -1 where a token has none
        shape = next(r for r in routed if r is not None).shape[1:]
        experts = torch.full((batch.num_tokens, *shape), -1, dtype=torch.int64)
        for i, r in enumerate(routed):
            if r is not None:
                experts[bounds[i] : bounds[i] + len(r)] = r.to(torch.int64)
        batch.extras[ROUTED_EXPERTS] = experts
    if any(t.images is not None for t in trajectories):
        batch.extras.update(image_extras([t.images for t in trajectories]))
    return batch
