"""GRPO (and Dr. GRPO / RLOO) on verifiable rewards: rollouts -> rewards -> group advantages ->
PPO-clip update -> publish weights -> the rollout engine serves the new version.

Every rank runs an embedded `HFRolloutEngine` for its share of the prompts. After each
optimiser step rank 0 publishes the new weights with weight-sync's `DiskTransport` (atomic,
verified versions under ``output_dir/weights``) and every rank's rollout engine switches to
it, so step k+1 samples from the policy after update k (synchronous, on-policy). Old
log-probs are recomputed by the training engine before the update (``recompute_logprobs``),
so the first PPO ratio is exactly 1; the rollout engine's own log-probs are kept as
``behaviour_logprobs`` and their gap to the trainer's is logged (``behaviour_kl``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from shardforge.algorithms.config import EngineConfig
from shardforge.algorithms.config_io import config_to_dict
from shardforge.algorithms.data import GlobalBatchSampler
from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.metrics import MetricsLogger
from shardforge.algorithms.rl import PPOActorConfig, PPOActorLossFn, summarize_stats
from shardforge.algorithms.rl.loss_fns import OLD_LOGPROBS
from shardforge.algorithms.rl.stats import all_reduce_stats
from shardforge.algorithms.rlvr import (
    BEHAVIOUR_LOGPROBS,
    AdvantageEstimator,
    PromptSet,
    group_advantages,
    load_prompts,
    rollouts_to_batch,
)
from shardforge.algorithms.rollout import RolloutEngine, SamplingParams, load_reward_fn, score_rollouts
from shardforge.algorithms.rollout.factory import RolloutEngineKind, build_rollout_engine
from shardforge.algorithms.rollout.vllm_engine import VLLMOptions
from shardforge.algorithms.trainer_common import progress_bar, publish_to_rollout, with_total_steps
from shardforge.checkpoint_dcp import Checkpointer
from shardforge.weight_sync import DiskTransport

__all__ = ["GRPOConfig", "run_grpo"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    """Everything `shardforge train grpo` needs; YAML keys mirror these fields."""

    model: str
    """HF model directory of the starting policy (e.g. the SFT export)."""
    train_file: str
    """Prompt JSONL: {"prompt": ..., "completion": <reference answer>}."""
    output_dir: str
    """Metrics, published weights, checkpoints and the exported model."""
    tokenizer: str | None = None
    """Tokenizer directory; None = the model directory."""
    eval_file: str | None = None
    """Held-out prompt JSONL for greedy exact-match accuracy."""
    layout: str = "d-1"
    """Parallel layout of the trainer."""
    steps: int = 20
    """Optimizer steps (one rollout batch each)."""
    prompts_per_step: int = 16
    """Prompts per step across all data-parallel ranks (a multiple of the dp size)."""
    group_size: int = 8
    """Samples per prompt."""
    max_new_tokens: int = 8
    """Generation budget per response."""
    max_prompt_len: int | None = None
    """Skip prompts longer than this many tokens (None = keep all; they must fit the budget)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    advantage: AdvantageEstimator = "grpo"
    """grpo (group mean/std), dr_grpo (mean only) or rloo."""
    reward_fn: str = "exact_match"
    """'exact_match' or 'package.module:function' -> fn(prompt, response, reference) -> float."""
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    """PPO loss options (clip ranges, dual clip, aggregation, ...)."""
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
    """DCP checkpoint every this many steps (0 = never)."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest committed checkpoint in output_dir/checkpoints."""
    keep_last: int = 2
    """Committed checkpoints to keep."""
    export_hf_at_end: bool = True
    """Write an HF model directory to output_dir/hf at the end."""
    progress: bool = True
    """Progress bar on rank 0."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training engine settings."""


def _validate(config: GRPOConfig, prompts: PromptSet, dp_size: int) -> None:
    if config.prompts_per_step < 1 or config.prompts_per_step % dp_size:
        raise ValueError(
            f"prompts_per_step={config.prompts_per_step} must be a positive multiple of the data-parallel size "
            f"{dp_size} (every rank samples whole groups)"
        )
    if config.group_size < 1:
        raise ValueError(f"group_size={config.group_size} must be >= 1")
    if config.advantage != "dr_grpo" and config.group_size < 2:
        raise ValueError(f"advantage={config.advantage!r} needs group_size >= 2 (it compares samples of a prompt)")
    longest = max(len(p) for p in prompts.ids) + config.max_new_tokens
    budget = config.engine.max_tokens_per_microbatch
    if longest > budget:
        raise ValueError(
            f"the longest prompt + max_new_tokens is {longest} tokens but engine.max_tokens_per_microbatch={budget}; "
            f"raise the budget or set max_prompt_len to skip long prompts"
        )


def _global_reward_stats(rewards: torch.Tensor, lengths: torch.Tensor, engine: TrainEngine) -> dict[str, float]:
    values = torch.tensor(
        [rewards.numel(), rewards.sum(), (rewards**2).sum(), lengths.sum(), (rewards > 0).sum()], dtype=torch.float64
    )
    if engine.dp_group is not None:
        dist.all_reduce(values, group=engine.dp_group)
    count, total, squares, length, positive = values.tolist()
    mean = total / count
    return {
        "reward_mean": mean,
        "reward_std": math.sqrt(max(squares / count - mean * mean, 0.0)),
        "reward_positive_frac": positive / count,
        "response_len_mean": length / count,
    }


def evaluate_accuracy(
    rollout: RolloutEngine, prompts: PromptSet, engine: TrainEngine, max_new_tokens: int, limit: int | None
) -> float:
    """Greedy exact-match accuracy on held-out prompts, split across data-parallel ranks."""
    from shardforge.algorithms.rollout import exact_match_reward

    count = len(prompts) if limit is None else min(limit, len(prompts))
    mine = list(range(count))[engine.dp_rank :: engine.dp_size]
    correct = 0.0
    if mine:
        outs = rollout.generate(
            [prompts.ids[i] for i in mine], SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
        )
        correct = sum(exact_match_reward("", o.text, prompts.references[mine[o.prompt_index]]) for o in outs)
    values = torch.tensor([correct], dtype=torch.float64)
    if engine.dp_group is not None:
        dist.all_reduce(values, group=engine.dp_group)
    return float(values[0]) / count


def run_grpo(config: GRPOConfig) -> dict[str, Any]:
    """Train; return a summary (accuracy before/after, final reward). Call on every rank."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    prompts = load_prompts(config.train_file, tokenizer, max_prompt_len=config.max_prompt_len)
    held_out = load_prompts(config.eval_file, tokenizer) if config.eval_file else None
    reward_fn = load_reward_fn(config.reward_fn)
    engine_config = with_total_steps(config.engine, config.steps)
    engine = TrainEngine(config.model, config.layout, engine_config)
    _validate(config, prompts, engine.dp_size)
    if config.temperature > 0:  # train on the distribution the rollouts sample from
        engine.logprob_temperature = config.temperature
    out = Path(config.output_dir)
    weights_root = out / "weights"
    transport = DiskTransport(weights_root, keep_last=2) if engine.is_main else None
    if engine.is_main:
        (out / "config.json").write_text(json.dumps(config_to_dict(config), indent=2))
    checkpointer = (
        Checkpointer(out / "checkpoints", keep_last=config.keep_last)
        if (config.save_every > 0 or config.resume == "auto")
        else None
    )
    start = 0
    data_state = {"seed": config.seed, "prompts_per_step": config.prompts_per_step, "num_prompts": len(prompts)}
    if checkpointer is not None and config.resume == "auto" and engine.load(checkpointer) is not None:
        start = engine.step
    rollout = build_rollout_engine(
        config.rollout_engine, config.model, tokenizer, weights_root=weights_root, dtype=config.rollout_dtype,
        vllm=config.vllm, seed=config.seed,
    )  # fmt: skip
    next_version = publish_to_rollout(engine, transport, rollout, config.rollout_dtype)  # the starting weights
    sampler = GlobalBatchSampler(len(prompts), config.prompts_per_step, seed=config.seed)
    actor = PPOActorLossFn(config.actor)
    metrics = MetricsLogger(out, enabled=engine.is_main)
    summary: dict[str, Any] = {"steps": config.steps, "output_dir": str(out), "layout": engine.dims.to_string()}
    if held_out is not None:
        summary["accuracy_start"] = evaluate_accuracy(
            rollout, held_out, engine, config.max_new_tokens, config.eval_size
        )
        metrics.log(start, {"accuracy": summary["accuracy_start"]}, split="eval")
    bar = progress_bar(config.steps, start, engine.is_main and config.progress, "grpo")
    try:
        for step in range(start, config.steps):
            step_started = time.perf_counter()
            stats = _grpo_step(step, config, engine, rollout, prompts, sampler, actor, reward_fn)
            began = time.perf_counter()
            next_version = publish_to_rollout(engine, transport, rollout, config.rollout_dtype, next_version)
            stats["weight_sync_s"] = time.perf_counter() - began
            stats["step_s"] = time.perf_counter() - step_started  # rollouts + update + publish
            if not math.isfinite(stats["loss"]):
                raise FloatingPointError(f"GRPO loss became {stats['loss']} at step {step + 1}")
            metrics.log(step + 1, stats)
            summary["reward_mean"] = stats["reward_mean"]
            if bar is not None:
                bar.set_postfix(reward=f"{stats['reward_mean']:.3f}", len=f"{stats['response_len_mean']:.1f}")
                bar.update(1)
            last = step + 1 == config.steps
            if checkpointer is not None and config.save_every > 0 and ((step + 1) % config.save_every == 0 or last):
                engine.save(checkpointer, data_state)
            if held_out is not None and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
                accuracy = evaluate_accuracy(rollout, held_out, engine, config.max_new_tokens, config.eval_size)
                metrics.log(step + 1, {"accuracy": accuracy}, split="eval")
                summary["accuracy_end"] = accuracy
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
    if checkpointer is not None:
        checkpointer.close()
    if config.export_hf_at_end:
        engine.export_hf(out / "hf", tokenizer=tokenizer)
        summary["hf_dir"] = str(out / "hf")
    if engine.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if dist.is_initialized():
        dist.barrier()
    return summary


def _grpo_step(
    step: int,
    config: GRPOConfig,
    engine: TrainEngine,
    rollout: RolloutEngine,
    prompts: PromptSet,
    sampler: GlobalBatchSampler,
    actor: PPOActorLossFn,
    reward_fn: Any,
) -> dict[str, float]:
    started = time.perf_counter()
    indices = sampler.local_batch(step, engine.dp_rank, engine.dp_size)
    # The sampling seed is a function of (seed, step, dp rank): a resumed run samples the same.
    params = SamplingParams(
        n=config.group_size,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        seed=(config.seed * 1_000_003 + step) * 1_009 + engine.dp_rank,
    )
    rollouts = rollout.generate([prompts.ids[i] for i in indices], params)
    generated = time.perf_counter()
    local_texts = [prompts.texts[i] for i in indices]
    local_refs = [prompts.references[i] for i in indices]
    rewards = score_rollouts(rollouts, local_texts, local_refs, reward_fn)
    advantages = group_advantages(rewards, config.group_size, config.advantage)
    batch = rollouts_to_batch(rollouts, advantages)
    if config.recompute_logprobs:
        batch.extras[OLD_LOGPROBS] = engine.forward(batch)
    forwarded = time.perf_counter()
    stats = engine.train_batch(batch, actor, actor.loss_weight)
    actor_stats = all_reduce_stats(actor.pop_stats(), engine.dp_group)
    stats |= {f"actor/{k}": v for k, v in summarize_stats(actor_stats).items()}
    mask = batch.loss_mask != 0
    gap = (batch.extras[OLD_LOGPROBS] - batch.extras[BEHAVIOUR_LOGPROBS])[mask]
    stats["behaviour_kl"] = float(gap.abs().mean()) if gap.numel() else 0.0
    lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float64)
    stats |= _global_reward_stats(rewards.double(), lengths, engine)
    stats |= {
        "rollout_version": float(rollout.version),
        "generate_s": generated - started,
        "logprob_forward_s": forwarded - generated,
        "train_s": stats["step_time_s"],
        "tokens_per_s": stats["tokens"] / max(time.perf_counter() - started, 1e-9),
    }
    return stats
