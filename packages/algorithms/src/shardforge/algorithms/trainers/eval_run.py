"""``shardforge eval --config eval.yaml``: evaluate a model on held-out prompt sets without training.

Per dataset (each of ``eval_files``, named by its file stem): greedy accuracy, sampled avg@n and
unbiased pass@k, mean response lengths, with the same reward functions as training
(`trainers/rl_eval.py`). With a ``workflow`` section (``workflow.name=tool_use``, ...) every prompt
runs as episodes of that workflow instead: success@1, avg@n, pass@k, turns, tool calls and errors,
reward per turn (`trainers/workflow_eval.py`). Prompts are split over the data-parallel ranks of ``layout`` (launch with
``--nproc-per-node N``). Results go to ``output_dir/eval_results.json`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist

from shardforge.algorithms.config_io import config_to_dict
from shardforge.algorithms.data.prompts import PROMPT_ROW_FIELDS, load_prompts
from shardforge.algorithms.trainers import TrainerSpec
from shardforge.algorithms.trainers.rl.common import ROLLOUT_KEYS
from shardforge.algorithms.trainers.rl.eval import EvalSamplingConfig
from shardforge.algorithms.trainers.rl.workflow_eval import evaluate_held_out
from shardforge.algorithms.trainers.run.config import load_tokenizer
from shardforge.algorithms.trainers.run.startup_gc import end_startup_gc
from shardforge.engine.config import EngineConfig
from shardforge.rewards import load_reward_fn
from shardforge.rewards.guarded import GuardedReward, RewardConfig
from shardforge.rollout.config import RolloutConfig
from shardforge.rollout.factory import build_rollout_engine
from shardforge.rollout.workflows import WorkflowConfig, build_workflow

if TYPE_CHECKING:  # imported where built: the launching process reads the configs without the engine
    pass

__all__ = ["EvalConfig", "run_eval"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Everything ``shardforge eval`` needs; the sampling keys are those of an RL trainer's config."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = ROLLOUT_KEYS

    model: str
    """HF model directory to evaluate."""
    eval_files: tuple[str, ...]
    """Prompt/completion JSONL files (``completion`` = the reference); each is reported under its file stem."""
    output_dir: str
    """Where eval_results.json and metrics.jsonl go."""
    tokenizer: str | None = None
    """Tokenizer directory; None = the model directory."""
    layout: str = "d-1"
    """Layout of the ranks (prompts are split over its data-parallel ranks)."""
    reward_fn: str = "exact_match"
    """A registered reward function or 'package.module:function' -> fn(prompt, response, reference) -> float."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How reward functions run: timeout_s, max_concurrency, on_error."""
    max_new_tokens: int = 8
    """Generation budget per response."""
    max_prompt_len: int | None = None
    """Skip prompts longer than this many tokens (None = keep all)."""
    eval_size: int | None = None
    """Evaluate on the first N prompts of each file (None = all)."""
    eval_sampling: EvalSamplingConfig = field(default_factory=lambda: EvalSamplingConfig(samples=4, pass_k=(1, 4)))
    """Samples per prompt, temperature, pass_k, correctness threshold, seed."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine that generates (engine: hf | vllm | a user's, dtype, vllm options, ...; the ``rollout:``
    section, `shardforge.rollout.RolloutConfig`)."""
    seed: int = 0
    """Seed of the rollout engine."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine settings of the (forward-only) policy engine that places the ranks."""
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    """Evaluate episodes of this workflow (multi_turn, tool_use, a user's); the default: one response per prompt."""

    def __post_init__(self) -> None:
        if not self.eval_files:
            raise ValueError("eval_files is empty; list at least one prompt/completion JSONL file")
        stems = [Path(f).stem for f in self.eval_files]
        if len(set(stems)) != len(stems):
            raise ValueError(f"eval_files must have distinct file names (they name the results), got {stems}")


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """Evaluate every file; return ``{"results": {stem: metrics}, ...}``. Call on every rank."""
    out = Path(config.output_dir)
    tokenizer = load_tokenizer(config)  # type: ignore[arg-type]
    datasets = {
        Path(f).stem: load_prompts(f, tokenizer, max_prompt_len=config.max_prompt_len) for f in config.eval_files
    }
    if config.reward.ray_workers:
        raise ValueError(
            f"reward.ray_workers={config.reward.ray_workers}: shardforge eval scores rewards in process; set "
            "reward.ray_workers=0 (Ray reward workers are for `shardforge train grpo|ppo --launcher ray`)"
        )
    reward_fn = GuardedReward(load_reward_fn(config.reward_fn), config.reward, name=config.reward_fn)
    from shardforge.engine import TrainEngine

    engine = TrainEngine(config.model, config.layout, config.engine)
    rollout = build_rollout_engine(config.rollout, config.model, tokenizer, seed=config.seed)
    budget = config.workflow.max_total_tokens or config.engine.max_tokens_per_microbatch
    workflow = build_workflow(replace(config.workflow, max_total_tokens=budget), tokenizer, reward_fn)
    end_startup_gc()  # built: collect again while evaluating (startup_gc.py)
    results: dict[str, dict[str, float]] = {}
    for name, prompts in datasets.items():
        start = time.perf_counter()
        metrics = evaluate_held_out(
            rollout, prompts, engine, reward_fn, config.workflow, workflow, config.eval_sampling,
            config.max_new_tokens, config.eval_size,
        )  # fmt: skip
        count = len(prompts) if config.eval_size is None else min(config.eval_size, len(prompts))
        calls = reward_fn.pop_stats()
        results[name] = metrics | {"num_prompts": float(count), "time_s": time.perf_counter() - start}
        results[name] |= {k: v for k, v in calls.items() if k != "reward/calls"}  # this rank's failed calls
        logger.info("eval %s: %s", name, ", ".join(f"{k} {v:.4g}" for k, v in results[name].items()))
    summary = {"model": config.model, "results": results, "output_dir": str(out)}
    if engine.is_main:
        out.mkdir(parents=True, exist_ok=True)
        payload = {"config": config_to_dict(config), "results": results}
        tmp = out / "eval_results.json.tmp"
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        tmp.replace(out / "eval_results.json")
        with (out / "metrics.jsonl").open("a") as f:
            for name, metrics in results.items():
                f.write(json.dumps({"step": 0, "split": f"eval/{name}", "time": time.time(), **metrics}) + "\n")
        summary["results_file"] = str(out / "eval_results.json")
    reward_fn.close()
    if dist.is_initialized():  # no rank tears the process group down while rank 0 still writes
        dist.barrier()
    return summary


EVAL = TrainerSpec(config_cls=EvalConfig, run=run_eval, row_fields=PROMPT_ROW_FIELDS)
"""``shardforge eval`` (run through the same launcher and checks as ``shardforge train``)."""
