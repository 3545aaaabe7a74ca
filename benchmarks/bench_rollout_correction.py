"""Rollout correction under a controlled trainer/engine mismatch: GRPO with none / TIS / MIS / IcePop.

The rollout engine is the embedded HF engine with its weights perturbed after every weight update
(Gaussian noise, relative scale ``NOISE``, on every matrix; a fixed seed per version), so the engine
samples from a policy that differs from the trainer's by a known, constant amount: what different
kernels, precisions or MoE routing do on real systems, made larger and reproducible. GRPO then trains
the demo's untrained Qwen3 (3.2M weights) on a partial-credit reward (the share of "7" characters in
the response) for ``STEPS`` steps per correction mode, same prompts, seeds and noise in every mode.

Reports per mode: the reward of the last steps (mean of the last 5), the mismatch KL between trainer
and engine (``rollout_corr/kl_k3``, mean over steps) and the fraction of tokens the mode truncated or
masked; plots the reward curves. The ratio column is the final reward of the best correction over
no correction.

Run: ``python benchmarks/bench_rollout_correction.py`` from the repo root (several minutes).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "rollout_correction"
STEPS = 25
NOISE = 0.05
MODES = ("none", "token_tis", "token_mis", "icepop")


def sevens(prompt: str, response: str, reference: str) -> float:
    return response.count("7") / 6.0


def build_noisy_engine(model_dir: Any, tokenizer: Any, *, config: Any, weights_root: Any, **_: Any) -> Any:
    """A user rollout engine, selected by ``rollout.engine: bench_rollout_correction:build_noisy_engine``: the
    embedded HF engine serving the published weights plus fixed relative noise."""
    from shardforge.rollout.hf.engine import HFRolloutEngine

    class NoisyHFRolloutEngine(HFRolloutEngine):
        def update_weights(self, version: int | None = None) -> int:
            served = super().update_weights(version)
            gen = torch.Generator().manual_seed(1_000 + served)
            with torch.no_grad():
                for param in self.model.parameters():
                    if param.dim() == 2:
                        noise = torch.randn(param.shape, generator=gen) * NOISE * param.abs().mean()
                        param.add_(noise.to(param.dtype))
            return served

    return NoisyHFRolloutEngine(model_dir, tokenizer, weights_root=weights_root, dtype=config.dtype)


def run_mode(assets: dict[str, Any], out: Path, mode: str) -> list[dict[str, Any]]:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    data = {
        "model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(out),
        "layout": "d1", "steps": STEPS, "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 6,
        "temperature": 1.0, "progress": False, "save_every": 0, "resume": "never", "export_hf_at_end": False,
        "reward_fn": "bench_rollout_correction:sevens",
        "rollout": {"engine": "bench_rollout_correction:build_noisy_engine",
                    "publish_in_memory": False},  # the disk path calls update_weights, where the noise is added
        "rollout_correction": {"mode": mode},
        "engine": {"max_tokens_per_microbatch": 2048, "optimizer": {"lr": 1e-3, "max_grad_norm": 1.0}},
    }  # fmt: skip
    run_grpo(build_config(GRPOConfig, data))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def main() -> int:
    from shardforge.algorithms.demos.demo import prepare_demo

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    info = _common.machine_info()
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_rollout_correction_") as tmp:
        assets = prepare_demo(Path(tmp) / "demo", num_eval=8)
        for mode in MODES:
            runs[mode] = run_mode(assets, Path(tmp) / mode, mode)
    summary = {}
    for mode, rows in runs.items():
        dropped = [r.get("rollout_corr/masked_frac", 0.0) + r.get("rollout_corr/truncated_frac", 0.0) for r in rows]
        summary[mode] = {
            "final_reward": statistics.fmean(r["reward_mean"] for r in rows[-5:]),
            "mismatch_kl_k3": statistics.fmean(r.get("rollout_corr/kl_k3", r.get("behaviour_kl", 0.0)) for r in rows),
            "dropped_or_truncated_frac": statistics.fmean(dropped),
        }
    plt = _common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, rows in runs.items():
        ax.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], label=mode)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward of the samples")
    ax.set_title(f"rollout correction with engine weights perturbed by {NOISE:.0%} noise", fontsize=10)
    ax.legend()
    fig.tight_layout()
    png = _common.png_path(NAME)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    payload = {"machine": info, "steps": STEPS, "noise": NOISE, "summary": summary, "png": str(png)}
    payload["seconds"] = time.perf_counter() - started
    path = _common.write_json(NAME, payload)
    print(json.dumps(payload, indent=2))
    best = max((m for m in MODES if m != "none"), key=lambda m: summary[m]["final_reward"])
    ratio = summary[best]["final_reward"] / max(summary["none"]["final_reward"], 1e-9)
    _common.upsert_result_row(
        benchmark=NAME,
        metric=f"GRPO reward after {STEPS} steps with a {NOISE:.0%}-noise engine (mean of last 5)",
        ours=f"{best} {summary[best]['final_reward']:.3f}",
        baseline=f"none {summary['none']['final_reward']:.3f}",
        ratio=f"{ratio:.2f}",
        target=_common.target_cell(">= 1", ratio >= 1.0),
        machine=_common.machine_label(info),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
