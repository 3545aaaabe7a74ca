"""GRPO (and Dr. GRPO / RLOO) on verifiable rewards: rollouts -> rewards -> group advantages ->
PPO-clip update -> publish weights -> the rollout engine serves the new version.

Every rank runs a `RolloutEngine` (embedded HF generate by default) for its share of the prompts. After each
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from shardforge.algorithms.async_rollout import AsyncRollouts, PublishFn, SampledBatch, SampleFn
from shardforge.algorithms.config_io import config_to_dict
from shardforge.algorithms.data import GlobalBatchSampler
from shardforge.algorithms.engine import TrainEngine
from shardforge.algorithms.engine.config import EngineConfig
from shardforge.algorithms.metrics import MetricsLogger
from shardforge.algorithms.objectives import PPOActorConfig, PPOActorLossFn, summarize_stats
from shardforge.algorithms.objectives.loss_fns import OLD_LOGPROBS, PROXIMAL_LOGPROBS
from shardforge.algorithms.objectives.stats import all_reduce_stats
from shardforge.algorithms.rlvr import (
    BEHAVIOUR_LOGPROBS,
    AdvantageEstimator,
    PromptSet,
    group_advantages,
    load_prompts,
    rollouts_to_batch,
)
from shardforge.algorithms.rollout import Rollout, RolloutEngine, SamplingParams, load_reward_fn, score_rollouts
from shardforge.algorithms.rollout.factory import RolloutEngineKind, build_rollout_engine
from shardforge.algorithms.rollout.vllm_engine import VLLMOptions
from shardforge.algorithms.trainer_common import check_eval_split, progress_bar, publish_version, with_total_steps
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
    async_rollouts: bool = False
    """Generate the next batch in a background thread while the current step trains (decoupled PPO loss)."""
    max_staleness: int = 1
    """Async mode: batch k is generated with the weights after step max(k - max_staleness, 0); 0 = on-policy."""
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
    if config.max_staleness < 0:
        raise ValueError(f"max_staleness={config.max_staleness} must be >= 0 (0 = on-policy, no overlap)")
    if config.async_rollouts and not config.recompute_logprobs:
        raise ValueError(
            "async_rollouts needs recompute_logprobs=true: the decoupled loss uses the trainer's log-probs "
            "as the proximal policy (the rollout's are the behaviour policy)"
        )
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
    rollout: RolloutEngine,
    prompts: PromptSet,
    engine: TrainEngine,
    max_new_tokens: int,
    limit: int | None,
    *,
    runner: Callable[[Callable[[RolloutEngine], float]], float] | None = None,
) -> float:
    """Greedy exact-match accuracy on held-out prompts, split across data-parallel ranks.

    ``runner`` runs the local generation (e.g. `AsyncRollouts.evaluate`, on the thread that owns
    the rollout engine); the reduction across ranks always happens here, on the calling thread."""
    from shardforge.algorithms.rollout import exact_match_reward

    count = len(prompts) if limit is None else min(limit, len(prompts))
    mine = list(range(count))[engine.dp_rank :: engine.dp_size]

    def local_correct(engine_: RolloutEngine) -> float:
        if not mine:
            return 0.0
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
        outs = engine_.generate([prompts.ids[i] for i in mine], params)
        return float(sum(exact_match_reward("", o.text, prompts.references[mine[o.prompt_index]]) for o in outs))

    correct = local_correct(rollout) if runner is None else runner(local_correct)
    values = torch.tensor([correct], dtype=torch.float64)
    if engine.dp_group is not None:
        dist.all_reduce(values, group=engine.dp_group)
    return float(values[0]) / count


class _SyncRollouts:
    """Synchronous, on-policy: batch k is generated on the main thread with the weights after step k."""

    def __init__(self, rollout: RolloutEngine, sample_fn: SampleFn, publish_fn: PublishFn) -> None:
        self.rollout, self.sample_fn, self.publish_fn = rollout, sample_fn, publish_fn
        self._version = publish_fn(None)
        rollout.update_weights(self._version)

    def batch(self, index: int) -> SampledBatch:
        started = time.perf_counter()
        rollouts, rewards = self.sample_fn(index)
        elapsed = time.perf_counter() - started
        return SampledBatch(index=index, policy_step=index, rollouts=rollouts, rewards=rewards, generate_s=elapsed)

    def publish(self, policy_step: int) -> None:
        self._version = self.publish_fn(self._version + 1)
        self.rollout.update_weights(self._version)

    def evaluate(self, fn: Callable[[RolloutEngine], float]) -> float:
        return fn(self.rollout)

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def _sample_fn(
    config: GRPOConfig, rollout: RolloutEngine, prompts: PromptSet, reward_fn: Any, engine: TrainEngine
) -> SampleFn:
    sampler = GlobalBatchSampler(len(prompts), config.prompts_per_step, seed=config.seed)
    dp_rank, dp_size = engine.dp_rank, engine.dp_size

    def sample(index: int) -> tuple[list[Rollout], torch.Tensor]:
        indices = sampler.local_batch(index, dp_rank, dp_size)
        # The sampling seed depends only on (seed, batch index, dp rank): a resumed run, and the
        # asynchronous mode (batches generated on another thread), sample the same.
        params = SamplingParams(
            n=config.group_size,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            seed=(config.seed * 1_000_003 + index) * 1_009 + dp_rank,
        )
        rollouts = rollout.generate([prompts.ids[i] for i in indices], params)
        texts = [prompts.texts[i] for i in indices]
        references = [prompts.references[i] for i in indices]
        return rollouts, score_rollouts(rollouts, texts, references, reward_fn)

    return sample


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
    check_eval_split(config, len(held_out) if held_out is not None else None, engine.dp_size)
    if config.temperature > 0:  # train on the distribution the rollouts sample from
        engine.logprob_temperature = config.temperature
    out = Path(config.output_dir)
    weights_root = out / "weights"
    # Async mode: the generator may still need the weights of max_staleness steps ago.
    keep_weights = max(2, config.max_staleness + 2) if config.async_rollouts else 2
    transport = DiskTransport(weights_root, keep_last=keep_weights) if engine.is_main else None
    if engine.is_main:
        (out / "config.json").write_text(json.dumps(config_to_dict(config), indent=2))
    checkpointer = (
        Checkpointer(out / "checkpoints", keep_last=config.keep_last)
        if (config.save_every > 0 or config.resume == "auto")
        else None
    )
    start = 0
    data_state = {"seed": config.seed, "prompts_per_step": config.prompts_per_step, "num_prompts": len(prompts)}
    loaded: dict[str, Any] | None = None
    if checkpointer is not None and config.resume == "auto":
        loaded = engine.load(checkpointer)
        start = engine.step if loaded is not None else 0
    rollout = build_rollout_engine(
        config.rollout_engine, config.model, tokenizer, weights_root=weights_root, dtype=config.rollout_dtype,
        vllm=config.vllm, seed=config.seed,
    )  # fmt: skip

    def publish(version: int | None) -> int:
        return publish_version(engine, transport, rollout, config.rollout_dtype, version)

    sample_fn = _sample_fn(config, rollout, prompts, reward_fn, engine)
    source: _SyncRollouts | AsyncRollouts
    if config.async_rollouts:
        source = AsyncRollouts(
            rollout=rollout,
            sample_fn=sample_fn,
            publish_fn=publish,
            max_staleness=config.max_staleness,
            num_batches=config.steps,
            start=start,
            dp_rank=engine.dp_rank,
            dp_size=engine.dp_size,
            restored=(loaded or {}).get("async_rollouts"),
        )
    else:
        source = _SyncRollouts(rollout, sample_fn, publish)
    actor = PPOActorLossFn(config.actor)
    metrics = MetricsLogger(out, enabled=engine.is_main)
    summary: dict[str, Any] = {"steps": config.steps, "output_dir": str(out), "layout": engine.dims.to_string()}
    bar = None
    try:
        if held_out is not None:
            summary["accuracy_start"] = evaluate_accuracy(
                rollout, held_out, engine, config.max_new_tokens, config.eval_size, runner=source.evaluate
            )
            metrics.log(start, {"accuracy": summary["accuracy_start"]}, split="eval")
        bar = progress_bar(config.steps, start, engine.is_main and config.progress, "grpo")
        for step in range(start, config.steps):
            step_started = time.perf_counter()
            sampled = source.batch(step)
            stats = _train_step(sampled, config, engine, actor, step_started)
            began = time.perf_counter()
            source.publish(step + 1)
            stats["weight_sync_s"] = time.perf_counter() - began
            stats["step_s"] = time.perf_counter() - step_started  # rollouts (or the wait) + update + publish
            if not math.isfinite(stats["loss"]):
                raise FloatingPointError(f"GRPO loss became {stats['loss']} at step {step + 1}")
            metrics.log(step + 1, stats)
            summary["reward_mean"] = stats["reward_mean"]
            if bar is not None:
                bar.set_postfix(reward=f"{stats['reward_mean']:.3f}", len=f"{stats['response_len_mean']:.1f}")
                bar.update(1)
            last = step + 1 == config.steps
            if checkpointer is not None and config.save_every > 0 and ((step + 1) % config.save_every == 0 or last):
                state = source.checkpoint_state()
                engine.save(checkpointer, data_state | ({"async_rollouts": state} if state else {}))
            if held_out is not None and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
                accuracy = evaluate_accuracy(
                    rollout, held_out, engine, config.max_new_tokens, config.eval_size, runner=source.evaluate
                )
                metrics.log(step + 1, {"accuracy": accuracy}, split="eval")
                summary["accuracy_end"] = accuracy
    finally:
        source.close()
        if bar is not None:
            bar.close()
        metrics.close()
    if checkpointer is not None:
        checkpointer.close()
    if config.export_hf_at_end:
        engine.export_hf(out / "hf", tokenizer=tokenizer)
        summary["hf_dir"] = str(out / "hf")
        if engine.config.lora is not None:  # also the adapters alone, in PEFT format
            engine.export_lora(out / "lora", base_model_name_or_path=config.model)
            summary["lora_dir"] = str(out / "lora")
    if engine.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if dist.is_initialized():
        dist.barrier()
    return summary


def _train_step(
    sampled: SampledBatch, config: GRPOConfig, engine: TrainEngine, actor: PPOActorLossFn, step_started: float
) -> dict[str, float]:
    """One PPO update on a sampled batch. A batch generated by older weights than the current ones
    (async mode) uses the decoupled loss: the trainer's recomputed log-probs are the proximal
    policy, the rollout's the behaviour policy; a fresh batch uses plain PPO-clip."""
    started = time.perf_counter()
    advantages = group_advantages(sampled.rewards, config.group_size, config.advantage)
    batch = rollouts_to_batch(sampled.rollouts, advantages)
    staleness = sampled.index - sampled.policy_step
    if config.recompute_logprobs:
        # Fresh batch: behaviour = proximal policy, so the decoupled weight would be exp(rounding
        # noise between the two engines); plain PPO with the recomputed log-probs is exact.
        key = OLD_LOGPROBS if staleness == 0 else PROXIMAL_LOGPROBS
        batch.extras[key] = engine.forward(batch)
    forwarded = time.perf_counter()
    stats = engine.train_batch(batch, actor, actor.loss_weight)
    actor_stats = all_reduce_stats(actor.pop_stats(), engine.dp_group)
    stats |= {f"actor/{k}": v for k, v in summarize_stats(actor_stats).items()}
    mask = batch.loss_mask != 0
    trainer_logprobs = batch.extras.get(PROXIMAL_LOGPROBS, batch.extras[OLD_LOGPROBS])
    gap = (trainer_logprobs - batch.extras[BEHAVIOUR_LOGPROBS])[mask]
    stats["behaviour_kl"] = float(gap.abs().mean()) if gap.numel() else 0.0
    lengths = torch.tensor([len(r.response_ids) for r in sampled.rollouts], dtype=torch.float64)
    stats |= _global_reward_stats(sampled.rewards.double(), lengths, engine)
    stats |= {
        "rollout_version": float(sampled.rollouts[0].version),
        "generate_s": sampled.generate_s,
        "logprob_forward_s": forwarded - started,
        "train_s": stats["step_time_s"],
        "tokens_per_s": stats["tokens"] / max(time.perf_counter() - step_started, 1e-9),
    }
    if config.async_rollouts:
        stats |= {
            "staleness": float(staleness),
            "rollout_policy_step": float(sampled.policy_step),
            "rollout_wait_s": sampled.wait_s,
            "generate_overlap_s": max(sampled.generate_s - sampled.wait_s, 0.0),
        }
    return stats


from shardforge.algorithms.trainers import TrainerSpec  # noqa: E402

TRAINER = TrainerSpec(config_cls=GRPOConfig, run=run_grpo)
"""This trainer for `shardforge train` (see `shardforge.algorithms.trainers.TRAINERS`)."""
