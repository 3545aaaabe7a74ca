"""PPO with a learned critic on verifiable rewards (`shardforge train ppo`).

Like GRPO (`shardforge.algorithms.grpo`: embedded rollout engine, weight publishing after each
step, reward functions, eval) but the advantage comes from a critic: a value-head `TrainEngine`
initialised from the policy checkpoint (new head) or from a reward-model directory. Each step:
rollouts -> sequence rewards -> optional KL-in-reward against a frozen reference policy ->
GAE on per-token values -> one actor step (PPO clip) and one critic step (value-clipped loss)
-> publish the actor's weights. See `shardforge.algorithms.ppo_step` for the update itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from shardforge.algorithms.config_io import config_to_dict
from shardforge.algorithms.data import GlobalBatchSampler
from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.engine.config import EngineConfig
from shardforge.algorithms.grpo import _global_reward_stats, evaluate_accuracy
from shardforge.algorithms.metrics import MetricsLogger
from shardforge.algorithms.objectives import KLEstimator, PPOActorConfig, PPOActorLossFn, PPOCriticConfig
from shardforge.algorithms.ppo_step import ShiftedCriticLossFn, ppo_update, prepare_ppo_batch
from shardforge.algorithms.rlvr import PromptSet, load_prompts, rollouts_to_batch
from shardforge.algorithms.rollout import RolloutEngine, SamplingParams, load_reward_fn, score_rollouts
from shardforge.algorithms.rollout.factory import RolloutEngineKind, build_rollout_engine
from shardforge.algorithms.rollout.vllm_engine import VLLMOptions
from shardforge.algorithms.sft import _check_data_state
from shardforge.algorithms.trainer_common import check_eval_split, progress_bar, publish_to_rollout, with_total_steps
from shardforge.checkpoint_dcp import Checkpointer
from shardforge.weight_sync import DiskTransport

__all__ = ["PPOConfig", "ShiftedCriticLossFn", "run_ppo"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOConfig:
    """Everything `shardforge train ppo` needs; YAML keys mirror these fields."""

    model: str
    """HF model directory of the starting policy (e.g. the SFT export)."""
    train_file: str
    """Prompt JSONL: {"prompt": ..., "completion": <reference answer>}."""
    output_dir: str
    """Metrics, published weights, checkpoints and the exported actor (hf/) and critic (critic_hf/)."""
    critic_model: str | None = None
    """Critic start: a reward-model / value-model directory or an LM directory (new head); None = model."""
    reference_model: str | None = None
    """Frozen reference policy for the KL-in-reward term; None = model. Built only when kl_coef > 0."""
    tokenizer: str | None = None
    """Tokenizer directory; None = the model directory."""
    eval_file: str | None = None
    """Held-out prompt JSONL for greedy exact-match accuracy."""
    layout: str = "d-1"
    """Parallel layout of the actor, critic and reference engines (no pp for the critic)."""
    steps: int = 20
    """PPO iterations (one rollout batch each)."""
    update_epochs: int = 2
    """Optimizer steps of the actor and of the critic per rollout batch (clipping acts from the second)."""
    prompts_per_step: int = 16
    """Prompts per step across all data-parallel ranks (a multiple of the dp size)."""
    group_size: int = 1
    """Samples per prompt."""
    max_new_tokens: int = 8
    """Generation budget per response."""
    max_prompt_len: int | None = None
    """Skip prompts longer than this many tokens."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    reward_fn: str = "exact_match"
    """'exact_match' or 'package.module:function' -> fn(prompt, response, reference) -> float."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0 / std 1 over the global batch."""
    kl_coef: float = 0.0
    """Per-token KL penalty to the reference policy, subtracted from the reward (0 = no reference)."""
    kl_estimator: KLEstimator = "k1"
    """KL estimator of the penalty (k1 = log pi - log pi_ref)."""
    offload_reference: bool = False
    """Keep the reference policy's weights in host memory except during its forward (on an accelerator
    this frees its whole footprint for the actor; a no-op on CPU). The critic's equivalent is
    ``critic_engine.offload_when_idle``."""
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    """Actor PPO loss options."""
    critic: PPOCriticConfig = field(default_factory=PPOCriticConfig)
    """Critic loss options (value clip, mse/huber)."""
    recompute_logprobs: bool = True
    """Recompute old log-probs with the trainer before the update (else use the rollout's)."""
    rollout_dtype: str = "float32"
    """Dtype of the rollout model and of the published weights."""
    rollout_engine: RolloutEngineKind = "hf"
    """'hf' (embedded generate in every trainer process) or 'vllm' (optional extra; see `vllm`)."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """vLLM rollout engine options (rollout_engine=vllm only)."""
    eval_every: int = 0
    """Greedy held-out accuracy every this many steps (0 = at the start and the end only)."""
    eval_size: int | None = None
    """Evaluate on the first N held-out prompts (None = all)."""
    seed: int = 0
    """Prompt order and sampling seed."""
    save_every: int = 0
    """DCP checkpoint (actor and critic) every this many steps (0 = never)."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest committed checkpoints in output_dir."""
    keep_last: int = 2
    """Committed checkpoints to keep."""
    export_hf_at_end: bool = True
    """Write the actor to output_dir/hf and the critic to output_dir/critic_hf at the end."""
    progress: bool = True
    """Progress bar on rank 0."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Actor engine settings."""
    critic_engine: EngineConfig = field(default_factory=EngineConfig)
    """Critic engine settings (head is forced to "value")."""


def _validate(config: PPOConfig, prompts: PromptSet, dp_size: int) -> None:
    if config.prompts_per_step < 1 or config.prompts_per_step % dp_size:
        raise ValueError(
            f"prompts_per_step={config.prompts_per_step} must be a positive multiple of the data-parallel size "
            f"{dp_size}"
        )
    if config.update_epochs < 1:
        raise ValueError(f"update_epochs={config.update_epochs} must be >= 1")
    if config.group_size < 1:
        raise ValueError(f"group_size={config.group_size} must be >= 1")
    if config.kl_coef < 0:
        raise ValueError(f"kl_coef={config.kl_coef} must be >= 0")
    longest = max(len(p) for p in prompts.ids) + config.max_new_tokens
    budget = min(config.engine.max_tokens_per_microbatch, config.critic_engine.max_tokens_per_microbatch)
    if longest > budget:
        raise ValueError(
            f"the longest prompt + max_new_tokens is {longest} tokens but the smaller max_tokens_per_microbatch of "
            f"engine/critic_engine is {budget}; raise it or set max_prompt_len to skip long prompts"
        )


def run_ppo(config: PPOConfig) -> dict[str, Any]:
    """Train; return a summary (accuracy before/after, final reward). Call on every rank."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    prompts = load_prompts(config.train_file, tokenizer, max_prompt_len=config.max_prompt_len)
    held_out = load_prompts(config.eval_file, tokenizer) if config.eval_file else None
    reward_fn = load_reward_fn(config.reward_fn)
    total = config.steps * config.update_epochs
    actor = TrainEngine(config.model, config.layout, with_total_steps(config.engine, total))
    _validate(config, prompts, actor.dp_size)
    check_eval_split(config, len(held_out) if held_out is not None else None, actor.dp_size)
    critic_config = dataclasses.replace(with_total_steps(config.critic_engine, total), head="value")
    critic = TrainEngine(config.critic_model or config.model, config.layout, critic_config)
    reference = None
    if config.kl_coef > 0:
        ref_config = config.engine
        if config.offload_reference:  # on the device only for its forward (cpu_offload would keep it on host)
            ref_config = dataclasses.replace(ref_config, offload_when_idle=True, cpu_offload=False)
        reference = TrainEngine(config.reference_model or config.model, config.layout, ref_config)
    if config.temperature > 0:  # log-probs of the distribution the rollouts sample from (as GRPO)
        for policy in (actor, reference):
            if policy is not None:
                policy.logprob_temperature = config.temperature
    out = Path(config.output_dir)
    weights_root = out / "weights"
    transport = DiskTransport(weights_root, keep_last=2) if actor.is_main else None
    if actor.is_main:
        (out / "config.json").write_text(json.dumps(config_to_dict(config), indent=2))
    checkpointers = None
    if config.save_every > 0 or config.resume == "auto":
        checkpointers = (
            Checkpointer(out / "checkpoints", keep_last=config.keep_last),
            Checkpointer(out / "critic_checkpoints", keep_last=config.keep_last),
        )
    start = 0
    data_state = {
        "seed": config.seed,
        "prompts_per_step": config.prompts_per_step,
        "num_prompts": len(prompts),
        "update_epochs": config.update_epochs,  # engine steps per iteration: the resume point depends on it
    }
    saved = actor.load(checkpointers[0]) if checkpointers is not None and config.resume == "auto" else None
    if saved is not None and checkpointers is not None:
        _check_data_state(saved, data_state)
        if critic.load(checkpointers[1], step=actor.step) is None:
            raise FileNotFoundError(f"actor checkpoint at step {actor.step} has no matching critic checkpoint")
        start = actor.step // config.update_epochs
    rollout = build_rollout_engine(
        config.rollout_engine, config.model, tokenizer, weights_root=weights_root, dtype=config.rollout_dtype,
        vllm=config.vllm, seed=config.seed,
    )  # fmt: skip
    version = publish_to_rollout(actor, transport, rollout, config.rollout_dtype)
    sampler = GlobalBatchSampler(len(prompts), config.prompts_per_step, seed=config.seed)
    actor_fn, critic_fn = PPOActorLossFn(config.actor), ShiftedCriticLossFn(config.critic)
    metrics = MetricsLogger(out, enabled=actor.is_main)
    summary: dict[str, Any] = {"steps": config.steps, "output_dir": str(out), "layout": actor.dims.to_string()}
    if held_out is not None:
        summary["accuracy_start"] = evaluate_accuracy(rollout, held_out, actor, config.max_new_tokens, config.eval_size)
        metrics.log(start, {"accuracy": summary["accuracy_start"]}, split="eval")
    bar = progress_bar(config.steps, start, actor.is_main and config.progress, "ppo")
    try:
        for step in range(start, config.steps):
            started = time.perf_counter()
            batch, rewards, lengths = _rollout_batch(step, config, actor, rollout, prompts, sampler, reward_fn)
            generated, served = time.perf_counter(), float(rollout.version)  # the version that sampled
            stats = prepare_ppo_batch(
                batch, rewards, actor, critic, reference, gamma=config.gamma, lam=config.lam,
                kl_coef=config.kl_coef, kl_estimator=config.kl_estimator,
                whiten_advantages=config.whiten_advantages, recompute_logprobs=config.recompute_logprobs,
            )  # fmt: skip
            forwarded = time.perf_counter()
            stats |= ppo_update(batch, actor, critic, actor_fn, critic_fn, epochs=config.update_epochs)
            began = time.perf_counter()
            version = publish_to_rollout(actor, transport, rollout, config.rollout_dtype, version)
            stats |= _global_reward_stats(rewards.double(), lengths, actor)
            stats |= {
                "weight_sync_s": time.perf_counter() - began,
                "rollout_version": served,
                "generate_s": generated - started,
                "forward_s": forwarded - generated,
                "tokens_per_s": stats["tokens"] / max(time.perf_counter() - started, 1e-9),
            }
            if not (math.isfinite(stats["loss"]) and math.isfinite(stats["critic/loss"])):
                raise FloatingPointError(
                    f"PPO loss became {stats['loss']} (critic {stats['critic/loss']}) at step {step + 1}"
                )
            metrics.log(step + 1, stats)
            summary["reward_mean"] = stats["reward_mean"]
            if bar is not None:
                bar.set_postfix(reward=f"{stats['reward_mean']:.3f}", vloss=f"{stats['critic/loss']:.3f}")
                bar.update(1)
            last = step + 1 == config.steps
            if checkpointers is not None and config.save_every > 0 and ((step + 1) % config.save_every == 0 or last):
                actor.save(checkpointers[0], data_state)
                critic.save(checkpointers[1], data_state)
            if held_out is not None and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
                accuracy = evaluate_accuracy(rollout, held_out, actor, config.max_new_tokens, config.eval_size)
                metrics.log(step + 1, {"accuracy": accuracy}, split="eval")
                summary["accuracy_end"] = accuracy
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
    if checkpointers is not None:
        for checkpointer in checkpointers:
            checkpointer.close()
    if config.export_hf_at_end:
        actor.export_hf(out / "hf", tokenizer=tokenizer)
        critic.export_hf(out / "critic_hf", tokenizer=tokenizer)
        summary["hf_dir"], summary["critic_hf_dir"] = str(out / "hf"), str(out / "critic_hf")
    if actor.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if dist.is_initialized():
        dist.barrier()
    return summary


def _rollout_batch(
    step: int,
    config: PPOConfig,
    engine: TrainEngine,
    rollout: RolloutEngine,
    prompts: PromptSet,
    sampler: GlobalBatchSampler,
    reward_fn: Any,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    indices = sampler.local_batch(step, engine.dp_rank, engine.dp_size)
    params = SamplingParams(
        n=config.group_size,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        seed=(config.seed * 1_000_003 + step) * 1_009 + engine.dp_rank,  # resumed runs sample the same
    )
    rollouts = rollout.generate([prompts.ids[i] for i in indices], params)
    rewards = score_rollouts(
        rollouts, [prompts.texts[i] for i in indices], [prompts.references[i] for i in indices], reward_fn
    )
    batch = rollouts_to_batch(rollouts, torch.zeros(len(rollouts)))  # advantages come from GAE
    lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float64)
    return batch, rewards, lengths


from shardforge.algorithms.trainers import TrainerSpec  # noqa: E402

TRAINER = TrainerSpec(config_cls=PPOConfig, run=run_ppo)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
