"""The GRPO pair of bench_vs_trl.py: shardforge `train grpo` vs TRL's GRPOTrainer on the same prompts.

Both tools start from the demo's untrained Qwen3 (its samples rarely end early, so both generate
close to ``MAX_NEW_TOKENS`` per completion: the same amount of work), draw the same prompts per step
(shardforge's sampler order, written out for TRL's in-order sampler), sample ``GROUP`` completions per
prompt at the same temperature, score them with the same reward (`digit_reward`: it varies within a
group from the first step, so every step has a gradient on both sides), and take one token-mean
clipped update per batch with the same AdamW and constant learning rate. Seconds per step are the
wall time between optimizer-step ends after ``WARMUP`` steps (generation, reward, training and, for
shardforge, the in-memory weight publish to its embedded engine all count).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

STEPS = 8
WARMUP = 2
PROMPTS_PER_STEP = 16
GROUP = 8
MAX_NEW_TOKENS = 6
TEMPERATURE = 0.7
LR = 1e-5
CLIP = (0.2, 0.28)
SEED = 0
REWARD = "shardforge.algorithms.testing:digit_reward"


def launch(command: list[str], env: dict[str, str]) -> float:
    """Run ``command`` to completion (its stderr kept for the error message); return when it was launched."""
    import subprocess

    launched = time.time()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return launched


def train_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The train records of a shardforge run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("split", "train") == "train"]


def prepare_grpo(assets: dict[str, Any], root: Path, nproc: int) -> dict[str, Any]:
    """The prompts each step draws in shardforge (global order), written as TRL's in-order dataset."""
    from transformers import AutoTokenizer

    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig
    from shardforge.algorithms.trainers.rl.data import load_prompt_data

    config = build_config(GRPOConfig, {"model": assets["model"], "train_file": assets["train"], "output_dir": "x"})
    data = load_prompt_data(config, AutoTokenizer.from_pretrained(assets["model"]))
    sampler = data.sampler(PROMPTS_PER_STEP, SEED)
    rows = root / f"trl_grpo_prompts_{nproc}.jsonl"
    with rows.open("w") as fh:
        for step in range(STEPS):
            for rank in range(nproc):
                for i in sampler.local_batch(step, rank, nproc):
                    fh.write(json.dumps({"prompt": data.prompts.texts[i], "answer": data.prompts.references[i]}) + "\n")
    return {"grpo_rows": str(rows)}


def run_ours_grpo(assets: dict[str, Any], nproc: int, out: Path, env: dict[str, str]) -> dict[str, Any]:
    layout = "r2" if nproc == 2 else "d1"
    config = out / "config.json"
    config.write_text(
        json.dumps(
            {
                "model": assets["model"], "train_file": assets["train"], "output_dir": str(out / "run"),
                "layout": layout, "steps": STEPS, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP,
                "max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE, "reward_fn": REWARD,
                "advantage": "grpo", "seed": SEED, "log_every": 1, "export_hf_at_end": False,
                "resume": "never", "progress": False, "loggers": ["jsonl"],
                "actor": {"clip_eps_low": CLIP[0], "clip_eps_high": CLIP[1], "aggregation": "token-mean"},
                "engine": {
                    "data_parallel": "ddp" if nproc == 2 else "fsdp", "seed": SEED,
                    "optimizer": {"lr": LR, "weight_decay": 0.0, "max_grad_norm": 1.0},
                    "scheduler": {"kind": "constant", "warmup_steps": 0},
                },
            }
        )
    )  # fmt: skip
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config),
               "--nproc-per-node", str(nproc)]  # fmt: skip
    launched = launch(command, env)
    train = train_metrics(out / "run")
    return {"launched": launched, "step_end": [r["time"] for r in train],
            "reward": [r["reward_mean"] for r in train], "length": [r["response_len_mean"] for r in train]}  # fmt: skip


def run_trl_grpo(assets: dict[str, Any], nproc: int, out: Path, env: dict[str, str]) -> dict[str, Any]:
    args, result = out / "args.json", out / "trl.json"
    args.write_text(
        json.dumps(
            {
                "model": assets["model"], "rows": assets["grpo_rows"], "output_dir": str(out / "trl_out"),
                "steps": STEPS, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP,
                "max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE, "clip_eps_low": CLIP[0],
                "clip_eps_high": CLIP[1], "lr": LR, "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": SEED,
                "out": str(result),
            }
        )
    )  # fmt: skip
    worker = str(Path(__file__).resolve().parent / "trl_grpo_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               worker, str(args)]  # fmt: skip
    launched = launch(command, env)
    record = json.loads(result.read_text())
    return {"launched": launched, "step_end": record["step_end"], "reward": record["reward"],
            "length": record["length"]}  # fmt: skip


def summarise_grpo(run: dict[str, Any]) -> dict[str, float]:
    ends = run["step_end"]
    if len(ends) != STEPS:
        raise RuntimeError(f"expected {STEPS} step ends, got {len(ends)}")
    return {
        "s_per_step": (ends[-1] - ends[WARMUP - 1]) / (STEPS - WARMUP),
        "startup_s": ends[0] - run["launched"],
        "first_reward": run["reward"][0],
        "mean_length": sum(run["length"]) / len(run["length"]),
    }
