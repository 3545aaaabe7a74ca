"""PPO with a critic on the RL demo: streaming rollouts vs synchronous, held-out accuracy and steps/hour (issue 41's
"PPO streaming vs synchronous on the demo"). Not a `bench_*` script: each PPO run is a whole demo stage
(~10-20 minutes on 2 cores), so `nox -s benchmarks` does not run it.

    python benchmarks/demo_ppo_streaming.py [--out outputs/demo_ppo_streaming] [--steps 60] [--modes sync streaming]

1. The RL demo's model and data (`prepare_demo`, seed 0, 500 held-out pairs) and its SFT stage (450 steps at
   lr 3e-3: a model part way, `demos/demo_rl.py`), once; reused when ``<out>/sft/hf`` exists.
2. For each mode, PPO from that SFT model with the same settings (``examples/ppo_tiny.yaml`` with
   ``PPO_SETTINGS`` below, FSDP on 2 ranks):
   ``sync`` (``async_rollouts=false``) and ``streaming`` (``async_rollouts=true streaming_rollouts=true
   max_staleness=1``, token-level MIS capped at 5 as AReaL). Both train on ``steps x prompts_per_step`` prompts.
3. Greedy held-out exact match of each run's exported model, its standard error (binomial, 500 pairs) and the
   difference between the modes with its standard error; steps/hour from each run's wall time (the torchrun
   command, model loading included).

One JSON line per run is appended to ``<out>/results.jsonl``; a summary is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shardforge.algorithms.demos.demo import held_out_accuracy, prepare_demo

SFT_STEPS = 450
PPO_BASE = Path(__file__).resolve().parents[1] / "examples" / "ppo_tiny.yaml"  # gamma, lam; the rest is overridden
PPO_SETTINGS = [
    "prompts_per_step=64", "group_size=2", "max_new_tokens=6", "temperature=0.7", "reward_fn=exact_match",
    "kl_coef=0.0", "update_epochs=2", "eval_every=0", "save_every=0", "seed=0", "resume=never",
    "actor.clip_eps_low=0.2", "actor.clip_eps_high=0.28", "critic.value_clip=0.2", "critic.loss_type=mse",
    "engine.max_tokens_per_microbatch=2048", "engine.optimizer.lr=2e-4", "engine.scheduler.kind=constant",
    "engine.scheduler.warmup_steps=5", "critic_engine.max_tokens_per_microbatch=2048",
    "critic_engine.optimizer.lr=5e-4",
]  # fmt: skip
MODES = {
    "sync": ["async_rollouts=false"],
    "streaming": [
        "async_rollouts=true", "streaming_rollouts=true", "max_staleness=1", "rollout_correction.mode=token_mis",
        "rollout_correction.high=5.0",
    ],
}  # fmt: skip


def _torchrun(args: list[str]) -> float:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "shardforge.algorithms.cli", "train", *args,
    ]  # fmt: skip
    started = time.time()
    subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return time.time() - started


def _sft(out: Path) -> tuple[dict[str, Any], Path]:
    import shardforge.algorithms.demos as demos

    assets = prepare_demo(out / "assets", seed=0, num_eval=500)
    sft_dir = out / "sft"
    if not (sft_dir / "hf" / "config.json").exists():
        config = Path(demos.__file__).with_name("demo_sft.yaml")
        _torchrun([
            "sft", "--config", str(config), f"model={assets['model']}", f"train_file={assets['train']}",
            f"eval_file={assets['eval']}", f"output_dir={sft_dir}", f"steps={SFT_STEPS}", "layout=d2",
            f"engine.scheduler.total_steps={SFT_STEPS}", "eval_every=0", "engine.optimizer.lr=3e-3", "resume=never",
        ])  # fmt: skip
    return assets, sft_dir / "hf"


def _ppo(out: Path, assets: dict[str, Any], model: Path, mode: str, steps: int) -> dict[str, Any]:
    run_dir = out / mode
    seconds = _torchrun([
        "ppo", "--config", str(PPO_BASE), f"model={model}", f"train_file={assets['train']}", f"eval_file={assets['eval']}",
        f"output_dir={run_dir}", f"steps={steps}", "layout=d2", *PPO_SETTINGS, *MODES[mode],
    ])  # fmt: skip
    accuracy = held_out_accuracy(run_dir / "hf", assets["eval"])
    n = 500
    return {
        "mode": mode,
        "steps": steps,
        "accuracy": accuracy,
        "standard_error": math.sqrt(accuracy * (1 - accuracy) / n),
        "seconds": seconds,
        "steps_per_hour": steps * 3600 / seconds,
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/demo_ppo_streaming")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    assets, model = _sft(out)
    sft_accuracy = held_out_accuracy(model, assets["eval"])
    print(json.dumps({"stage": "sft", "accuracy": sft_accuracy}), flush=True)
    results = []
    for mode in args.modes:
        result = _ppo(out, assets, model, mode, args.steps)
        result["sft_accuracy"] = sft_accuracy
        with (out / "results.jsonl").open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)
        results.append(result)
    if len(results) == 2:
        a, b = results
        diff = b["accuracy"] - a["accuracy"]
        se = math.hypot(a["standard_error"], b["standard_error"])
        print(
            f"{b['mode']} - {a['mode']}: {diff:+.1%} held-out (SE {se:.1%}; within 2 SE: {abs(diff) <= 2 * se}); "
            f"steps/hour {b['steps_per_hour']:.0f} vs {a['steps_per_hour']:.0f} (x{b['steps_per_hour'] / a['steps_per_hour']:.2f})"
        )


if __name__ == "__main__":
    main()
