"""PPO steps on image prompts for layout-parity tests (`testing_vlm` builds the tiny VLM assets)."""

from __future__ import annotations

from typing import Any

__all__ = ["vlm_ppo_steps"]


def vlm_ppo_steps(
    model_dir: str, train: str, layout: str, steps: int = 2, group_size: int = 2, epochs: int = 2
) -> dict[str, Any]:
    """``steps`` PPO iterations on the image prompts of ``train``: the embedded HF rollout engine samples
    ``group_size`` responses per prompt with a layout-independent seed (every rank samples every prompt, then
    keeps its share), the critic (a value head on the same VLM, `engine.vision_value`) gives the old values,
    GAE (gamma 1, lambda 0.95, whitened over all ranks) the advantages, then ``epochs`` actor (PPO clip) and
    critic (clipped value loss) steps, lr 3e-3, and the actor is published in memory to the rollout engine.

    Returns per step: actor and critic losses, the critic's old values of this rank's tokens (``mine``
    gives their trajectory indices, ``cu_seqlens`` their sequences) and the rewards; at the end the critic's values of every trajectory of
    the last step (every rank forwards all of them; ``blind_values`` with zeroed pixels), and the full actor and critic weights."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms.data.prompts import load_image_prompts
    from shardforge.algorithms.testing.vlm import colour_overlap_reward
    from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
    from shardforge.algorithms.trainers.rl.ppo_update import ShiftedCriticLossFn, ppo_update, prepare_ppo_batch
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.batching.visual import VLM_PIXELS
    from shardforge.engine.config import OptimizerConfig
    from shardforge.engine.objectives import PPOActorLossFn, PPOCriticConfig
    from shardforge.engine.objectives.loss_fns import OLD_VALUES
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.hf.engine import HFRolloutEngine
    from shardforge.rollout.publish import InProcessPublisher
    from shardforge.rollout.workflows import PromptRow, WorkflowConfig, run_episodes
    from shardforge.rollout.workflows.rlvr import RLVRWorkflow

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = load_image_prompts(
        train, tokenizer, AutoImageProcessor.from_pretrained(model_dir), image_token="<|image_pad|>"
    )
    config = EngineConfig(optimizer=OptimizerConfig(lr=3e-3), max_tokens_per_microbatch=128)
    actor = TrainEngine(model_dir, layout, config)
    critic = TrainEngine(model_dir, layout, EngineConfig(optimizer=OptimizerConfig(lr=3e-3), head="value"))
    rollout = HFRolloutEngine(model_dir, tokenizer)
    workflow = RLVRWorkflow(WorkflowConfig(), tokenizer, colour_overlap_reward)
    actor_fn, critic_fn = PPOActorLossFn(), ShiftedCriticLossFn(PPOCriticConfig())
    rows = [PromptRow.from_prompts(prompts, i, index=i) for i in range(len(prompts))]
    mine = [i for i in range(len(rows) * group_size) if (i // group_size) % actor.dp_size == actor.dp_rank]
    out: dict[str, Any] = {
        "losses": [],
        "critic_losses": [],
        "old_values": [],
        "rewards": [],
        "mine": mine,
        "cu_seqlens": [],
    }
    trajectories: list[Any] = []
    for step in range(steps):
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2000 + step)
        trajectories = run_episodes(workflow, rollout, rows, group_size, params, drop_failed=False)
        rewards = torch.tensor([t.reward for t in trajectories])
        batch = trajectories_to_batch([trajectories[i] for i in mine], torch.zeros(len(mine)))
        prepare_ppo_batch(batch, rewards[mine], actor, critic, gamma=1.0, lam=0.95)
        stats = ppo_update(batch, actor, critic, actor_fn, critic_fn, epochs=epochs)
        out["losses"].append(stats["loss"])
        out["critic_losses"].append(stats["critic/loss"])
        out["old_values"].append(batch.extras[OLD_VALUES])
        out["cu_seqlens"].append(batch.cu_seqlens)
        out["rewards"].append([t.reward for t in trajectories])
        InProcessPublisher(rollout.receiver, "float32").publish(actor, None)
    everything = trajectories_to_batch(trajectories, torch.zeros(len(trajectories)))
    out["values"] = critic.forward(everything)
    everything.extras[VLM_PIXELS].zero_()
    out["blind_values"] = critic.forward(everything)
    out["loss_mask"] = everything.loss_mask
    out["actor_weights"] = actor.full_state_dict()
    out["critic_weights"] = critic.full_state_dict()
    return out
