"""Independent reference implementations that tests compare the production path with.

`rollouts_to_batch` packs single-turn `Rollout` s the way the trainers did before workflows (prompt + response,
targets on the response); `score_rollouts` scores them one call at a time. The trainers now pack `Trajectory` s
(`shardforge.algorithms.trainers.rl.batch.trajectories_to_batch`) and score through the request queue; tests
check that both give the same batches and rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardforge.engine.batching import PackedBatch, pack_sequences
from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS
from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
from shardforge.rewards import RewardFn
from shardforge.rollout import Rollout

__all__ = ["rollouts_to_batch", "score_rollouts", "weighted_nll_adamw_losses"]


def score_rollouts(
    rollouts: Sequence[Rollout],
    prompts: Sequence[str],
    references: Sequence[str],
    reward_fn: RewardFn,
) -> torch.Tensor:
    """[len(rollouts)] float32 rewards; raises with the offending prompt/response on failure.

    A `GuardedReward` scores the batch concurrently under its timeout and error policy."""
    score_many = getattr(reward_fn, "score_many", None)
    if score_many is not None:
        items = [(prompts[r.prompt_index], r.text, references[r.prompt_index]) for r in rollouts]
        return torch.tensor(score_many(items), dtype=torch.float32)
    rewards = []
    for rollout in rollouts:
        prompt, reference = prompts[rollout.prompt_index], references[rollout.prompt_index]
        try:
            value = float(reward_fn(prompt, rollout.text, reference))
        except Exception as exc:
            raise RuntimeError(
                f"the reward function raised on prompt {prompt!r}, response {rollout.text!r}: {exc!r}"
            ) from exc
        if not math.isfinite(value):
            raise ValueError(
                f"the reward function returned {value} for prompt {prompt!r}, response {rollout.text!r}; "
                "rewards must be finite numbers"
            )
        rewards.append(value)
    return torch.tensor(rewards, dtype=torch.float32)


def rollouts_to_batch(rollouts: Sequence[Rollout], advantages: torch.Tensor) -> PackedBatch:
    """Pack prompt + response per rollout; targets are the response tokens.

    Extras (target-aligned [T]): ``advantages`` (the sequence's advantage on each response
    token), ``old_logprobs`` and ``behaviour_logprobs`` (both the rollout engine's log-probs;
    a trainer may overwrite ``old_logprobs`` with recomputed ones).
    """
    if len(rollouts) != advantages.numel():
        raise ValueError(f"{len(rollouts)} rollouts but {advantages.numel()} advantages")
    sequences = [r.prompt_ids + r.response_ids for r in rollouts]
    masks = [[0.0] * len(r.prompt_ids) + [1.0] * len(r.response_ids) for r in rollouts]
    batch = pack_sequences(sequences, masks)
    adv = torch.zeros(batch.num_tokens)
    behaviour = torch.zeros(batch.num_tokens)
    bounds = batch.cu_seqlens.tolist()
    for i, rollout in enumerate(rollouts):
        start = bounds[i] + len(rollout.prompt_ids)
        end = start + len(rollout.response_ids)
        adv[start:end] = float(advantages[i])
        behaviour[start:end] = torch.tensor(rollout.logprobs, dtype=torch.float32)
    batch.extras = {ADVANTAGES: adv, OLD_LOGPROBS: behaviour.clone(), BEHAVIOUR_LOGPROBS: behaviour}
    return batch


def weighted_nll_adamw_losses(model: torch.nn.Module, optimizer: torch.optim.Optimizer, datums: Sequence[Any],
                              steps: int) -> list[float]:  # fmt: skip
    """What Tinker's ``cross_entropy`` forward_backward + ``optim_step`` do, in plain torch: per step the
    sum-reduced, weighted NLL of every datum (a tinker ``Datum``: ``model_input`` ids, ``target_tokens``,
    ``weights``) backpropagated, then one ``optimizer`` step; the per-step losses."""
    losses = []
    for _ in range(steps):
        total = torch.zeros(())
        for d in datums:
            ids = torch.tensor([d.model_input.to_ints()])
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
            weights = torch.tensor(d.loss_fn_inputs["weights"].tolist())
            logp = torch.log_softmax(model(input_ids=ids).logits.float()[0], -1).gather(-1, targets[:, None])[:, 0]
            total = total - (logp * weights).sum()
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total.detach()))
    return losses
