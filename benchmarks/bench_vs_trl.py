"""shardforge vs TRL 1.16, SFT and GRPO, on the same model, data, batch order, optimiser and cores.

What runs (``nox -s bench_trl``: the workspace plus ``trl`` and ``accelerate`` pinned, in its own venv):

* the demo's tiny Qwen3 (3.2M weights, char tokenizer) and addition data, made locally;
* shardforge: ``shardforge train sft`` as a user runs it (2 processes: ``layout=r2
  engine.data_parallel=ddp``, the layout the planner proposes for a model this small; 1 process:
  world 1), constant learning rate, no eval, no HF export;
* TRL: ``trl.SFTTrainer`` (benchmarks/trl_sft_worker.py) under ``torchrun`` (DDP over gloo) or
  alone, on the rows shardforge's own SFT loader tokenised (same ids, same completion masks), read
  in shardforge's global-batch order, so step k of both trains on the same sequences; padded
  batches (TRL's default: HF SDPA ignores packed position ids in transformers 5); fp32 on both
  sides (TRL's SFTConfig defaults to bf16=True, CPU autocast that is ~20x slower on a CPU
  without native bf16, so the worker sets bf16=False);
* one intra-op thread per process on both sides; the runs alternate A, B, A, B for ``ROUNDS``
  rounds so both see the same machine load.

Reported per configuration: real (non-pad) tokens/s over the steps after ``WARMUP`` (the wall
time between optimizer-step ends, so data loading and logging count on both sides), the time
from launching the command to the end of the first step (start-up), min and median of the
paired per-round ratios, the 1-minute load average at each run, and both tools' first-step
losses (same weights, same data: they must agree, or the comparison is of different work).

GRPO (2 processes, benchmarks/_trl_grpo.py and trl_grpo_worker.py): `shardforge train grpo` (r2 DDP,
embedded engine, in-memory publish) vs ``trl.GRPOTrainer`` under ``torchrun`` on the same prompts per
step, group size, temperature, reward, clip range and optimiser; seconds per step, start-up, and as the
same-work check the first step's mean reward and the mean completion length (samples differ: they
must agree statistically, not exactly). ``BENCH_TRL_ONLY=grpo_2proc`` runs one workload.

Without ``trl`` installed (``nox -s benchmarks``) it prints how to run it and exits 0.
Run: ``nox -s bench_trl`` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from _trl_grpo import (
    GROUP,
    MAX_NEW_TOKENS,
    PROMPTS_PER_STEP,
    launch,
    prepare_grpo,
    run_ours_grpo,
    run_trl_grpo,
    summarise_grpo,
    train_metrics,
)

NAME = "sft_vs_trl"
HERE = Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("BENCH_TRL_ROUNDS", "3"))
STEPS = 12
WARMUP = 2
GLOBAL_BATCH = 64
LR = 1e-3
WEIGHT_DECAY = 0.0
MAX_GRAD_NORM = 1.0
SEED = 0
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def prepare(root: Path) -> dict[str, Any]:
    """Demo model + data; the TRL rows in shardforge's batch order; per-step real token counts."""
    from transformers import AutoTokenizer

    from shardforge.algorithms.data import GlobalBatchSampler, load_sft_examples
    from shardforge.algorithms.demos.demo import prepare_demo

    assets = prepare_demo(root / "demo")
    tokenizer = AutoTokenizer.from_pretrained(str(assets["model"]))
    examples = load_sft_examples(assets["train"], tokenizer)
    sampler = GlobalBatchSampler(len(examples), GLOBAL_BATCH, seed=SEED)
    order = [i for step in range(STEPS) for i in sampler.global_batch(step)]
    rows = root / "trl_rows.jsonl"
    with rows.open("w") as fh:
        for i in order:
            ex = examples[i]
            fh.write(json.dumps({"input_ids": ex.input_ids, "completion_mask": [int(m) for m in ex.loss_mask]}) + "\n")
    tokens = [sum(len(examples[i].input_ids) for i in sampler.global_batch(s)) for s in range(STEPS)]
    return {"model": str(assets["model"]), "train": str(assets["train"]), "rows": str(rows), "tokens": tokens}


def _load() -> float:
    return os.getloadavg()[0]


def run_ours(assets: dict[str, Any], nproc: int, out: Path) -> dict[str, Any]:
    layout = "r2" if nproc == 2 else "d1"
    config = out / "config.json"  # YAML is a superset of JSON
    config.write_text(
        json.dumps(
            {
                "model": assets["model"],
                "train_file": assets["train"],
                "output_dir": str(out / "run"),
                "layout": layout,
                "steps": STEPS,
                "global_batch_size": GLOBAL_BATCH,
                "log_every": 1,
                "seed": SEED,
                "export_hf_at_end": False,
                "resume": "never",
                "progress": False,
                "loggers": ["jsonl"],  # TRL's worker logs to no tracker (report_to=[]): no TensorBoard here either
                "engine": {
                    "data_parallel": "ddp" if nproc == 2 else "fsdp",
                    "seed": SEED,
                    "optimizer": {"lr": LR, "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM},
                    "scheduler": {"kind": "constant", "warmup_steps": 0},
                },
            }
        )
    )
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "sft", "--config", str(config),
               "--nproc-per-node", str(nproc)]  # fmt: skip
    launched = launch(command, ENV)
    train = train_metrics(out / "run")
    return {"launched": launched, "step_end": [r["time"] for r in train], "loss": [r["loss"] for r in train]}


def run_trl(assets: dict[str, Any], nproc: int, out: Path) -> dict[str, Any]:
    args = out / "args.json"
    result = out / "trl.json"
    args.write_text(
        json.dumps(
            {
                "model": assets["model"],
                "rows": assets["rows"],
                "output_dir": str(out / "trl_out"),
                "steps": STEPS,
                "global_batch_size": GLOBAL_BATCH,
                "lr": LR,
                "weight_decay": WEIGHT_DECAY,
                "max_grad_norm": MAX_GRAD_NORM,
                "seed": SEED,
                "out": str(result),
            }
        )
    )
    worker = str(HERE / "trl_sft_worker.py")
    if nproc == 1:
        command = [sys.executable, worker, str(args)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   worker, str(args)]  # fmt: skip
    launched = launch(command, ENV)
    record = json.loads(result.read_text())
    return {"launched": launched, "step_end": record["step_end"], "loss": record["loss"]}


def summarise(run: dict[str, Any], tokens: list[int]) -> dict[str, float]:
    ends = run["step_end"]
    if len(ends) != STEPS:
        raise RuntimeError(f"expected {STEPS} step ends, got {len(ends)}")
    timed = sum(tokens[WARMUP:]) / (ends[-1] - ends[WARMUP - 1])
    return {"tokens_per_s": timed, "startup_s": ends[0] - run["launched"], "first_loss": run["loss"][0]}


def _run_checked(label: str, fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"[{NAME}] {label} failed (exit {exc.returncode}):\n{(exc.stderr or '')[-3000:]}") from None


def _sft_pair(assets: dict[str, Any], nproc: int) -> dict[str, Any]:
    """Each tool's run (output dir -> summary), the speed key and the same-work check of the SFT workload."""
    return {
        "shardforge": lambda out: summarise(run_ours(assets, nproc, out), assets["tokens"]),
        "trl": lambda out: summarise(run_trl(assets, nproc, out), assets["tokens"]),
        "speed": "tokens_per_s",
        "check": "first_loss",
    }


def _grpo_pair(assets: dict[str, Any], nproc: int) -> dict[str, Any]:
    return {
        "shardforge": lambda out: summarise_grpo(run_ours_grpo(assets, nproc, out, ENV)),
        "trl": lambda out: summarise_grpo(run_trl_grpo(assets, nproc, out, ENV)),
        "speed": "s_per_step",
        "check": "first_reward",
    }


WORKLOADS = {"sft_2proc": (_sft_pair, 2), "sft_1proc": (_sft_pair, 1), "grpo_2proc": (_grpo_pair, 2)}
TARGETS = {"sft_2proc": (">= 1.2x", 1.2), "sft_1proc": (">= 1.0x", 1.0), "grpo_2proc": ("<= 0.85x", 0.85)}


def _fmt(run: dict[str, float]) -> str:
    speed = f"{run['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in run else f"{run['s_per_step']:.2f} s/step"
    return ", ".join([speed, f"start-up {run['startup_s']:.1f} s", f"load {run['load']:.1f}"] +
                     [f"{k} {v:.4f}" for k, v in run.items() if k.startswith(("first_", "mean_"))])  # fmt: skip


def _summary(tools: dict[str, list[dict[str, float]]], speed: str, check: str) -> dict[str, Any]:
    ours, theirs = tools["shardforge"], tools["trl"]
    ratio = [a[speed] / b[speed] for a, b in zip(ours, theirs)]
    return {
        speed: {t: statistics.median(r[speed] for r in rs) for t, rs in tools.items()},
        "startup_s": {t: statistics.median(r["startup_s"] for r in rs) for t, rs in tools.items()},
        "ratio_min": min(ratio),
        "ratio_max": max(ratio),
        "ratio_median": statistics.median(ratio),
        "startup_ratio_median": statistics.median(a["startup_s"] / b["startup_s"] for a, b in zip(ours, theirs)),
        f"{check}_rel_gap": max(abs(a[check] - b[check]) / abs(b[check]) for a, b in zip(ours, theirs)),
        "loads": [r["load"] for rs in tools.values() for r in rs],
    }


def main() -> int:
    if importlib.util.find_spec("trl") is None:
        print(f"[{NAME}] skipped: trl is not installed here; run `nox -s bench_trl` (its own venv with trl)")
        return 0
    import trl

    started = time.perf_counter()
    info = _common.machine_info()
    only = os.environ.get("BENCH_TRL_ONLY", "")  # e.g. "grpo_2proc": run one workload
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        root = Path(tmp)
        assets = prepare(root)
        assets |= prepare_grpo(assets, root, 2)
        for key, (make_pair, nproc) in WORKLOADS.items():
            if only and key not in only.split(","):
                continue
            pair = make_pair(assets, nproc)
            results[key] = {"shardforge": [], "trl": []}
            for index in range(ROUNDS):
                order = ("shardforge", "trl") if index % 2 == 0 else ("trl", "shardforge")
                for tool in order:
                    out = root / f"{key}-{tool}-{index}"
                    out.mkdir()
                    load = _load()
                    run = _run_checked(f"{tool} {key}", pair[tool], out) | {"load": load}
                    results[key][tool].append(run)
                    print(f"[{NAME}] {key} round {index + 1} {tool}: {_fmt(run)}", flush=True)
    summary = {key: _summary(tools, *_speed_check(key)) for key, tools in results.items()}
    payload = {
        "benchmark": NAME,
        "description": "shardforge vs TRL, alternated: SFT (r2 DDP / world 1 vs SFTTrainer) and GRPO (r2 DDP vs "
        "GRPOTrainer, 2 processes)",
        "trl": trl.__version__,
        "rounds": ROUNDS,
        "summary": summary,
        "runs": results,
        "machine": info,
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    json_path = _common.write_json(NAME, payload)
    for key, s in summary.items():
        _write_row(key, s, trl.__version__, info)
    startups = [a["startup_s"] / b["startup_s"] for t in results.values() for a, b in zip(t["shardforge"], t["trl"])]
    if startups:
        median = statistics.median(startups)
        _common.upsert_result_row(
            benchmark="startup_vs_trl",
            metric=f"seconds from command to the end of step 1, shardforge / TRL {trl.__version__}, median of all "
            f"{len(startups)} paired runs ({', '.join(summary)})",
            ours=", ".join(f"{k} {s['startup_s']['shardforge']:.1f} s" for k, s in summary.items()),
            baseline=", ".join(f"{k} {s['startup_s']['trl']:.1f} s" for k, s in summary.items()),
            ratio=f"{median:.2f} (min {min(startups):.2f}, max {max(startups):.2f})",
            target=_common.target_cell("<= 1.0x", median <= 1.0),
            machine=_common.machine_label(info),
        )
    print(f"[{NAME}] wrote {json_path}")
    return 0


def _speed_check(key: str) -> tuple[str, str]:
    return ("s_per_step", "first_reward") if key.startswith("grpo") else ("tokens_per_s", "first_loss")


def _write_row(key: str, s: dict[str, Any], version: str, info: dict[str, Any]) -> None:
    label, target = TARGETS[key]
    speed, check = _speed_check(key)
    met = s["ratio_median"] <= target if speed == "s_per_step" else s["ratio_median"] >= target
    what = (
        f"GRPO seconds/step, 2 processes x 1 thread ({PROMPTS_PER_STEP} prompts x {GROUP}, {MAX_NEW_TOKENS} new "
        f"tokens), shardforge vs TRL {version} GRPOTrainer"
        if speed == "s_per_step"
        else f"SFT real tokens/s, {key[4]} process(es) x 1 thread, shardforge vs TRL {version}"
    )
    fmt = "{:.2f}" if speed == "s_per_step" else "{:,.0f}"
    _common.upsert_result_row(
        benchmark=f"{key.split('_')[0]}_vs_trl_{key.split('_')[1]}",
        metric=f"{what}; median of {ROUNDS} paired rounds (start-up ratio {s['startup_ratio_median']:.2f}, "
        f"{check.replace('_', '-')} gap {s[f'{check}_rel_gap']:.1e}, load {min(s['loads']):.1f}-{max(s['loads']):.1f})",
        ours=fmt.format(s[speed]["shardforge"]),
        baseline=fmt.format(s[speed]["trl"]),
        ratio=f"{s['ratio_median']:.2f} (min {s['ratio_min']:.2f}, max {s['ratio_max']:.2f})",
        target=_common.target_cell(label, met),
        machine=_common.machine_label(info),
    )
    print(f"[{NAME}] {key}: shardforge / TRL {speed} = {s['ratio_median']:.2f} (target {label}), start-up "
          f"{s['startup_s']['shardforge']:.1f} s vs {s['startup_s']['trl']:.1f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
