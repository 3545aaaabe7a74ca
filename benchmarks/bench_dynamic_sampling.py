"""Dynamic sampling (DAPO): the share of trained tokens that carry a learning signal, and what it costs.

GRPO on the demo's untrained Qwen3 (3.2M weights) with a binary verifier that this model passes
now and then (reward 1 when the response contains a "7"): most groups are all-fail, their
advantages are all zero and their tokens train nothing. With ``dynamic_sampling.enabled`` those
groups are dropped and the step backfills from more prompts (up to ``max_rounds`` generation
rounds). Same prompts, seeds and model in both modes, alternated (A, B, A, B) in this process,
one thread.

Reports, per mode: ``advantage_nonzero_frac`` (trained tokens with a non-zero advantage; target
1.0 with dynamic sampling), generation seconds and step seconds per step, groups generated per
kept group, and rounds per step. The ratio column is the generation-time cost of the filter.

Run: ``python benchmarks/bench_dynamic_sampling.py`` from the repo root (a few minutes).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "dynamic_sampling"
ROUNDS = 2
STEPS = 5
MODES = {"off": {"dynamic_sampling.enabled": "false"}, "on": {"dynamic_sampling.enabled": "true"}}


def binary_seven(prompt: str, response: str, reference: str) -> float:
    return float("7" in response)


def run_mode(assets: dict[str, Any], out: Path, overrides: dict[str, str]) -> list[dict[str, Any]]:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    data = {
        "model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(out),
        "layout": "d1", "steps": STEPS, "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 6,
        "temperature": 1.0, "progress": False, "save_every": 0, "resume": "never", "export_hf_at_end": False,
        "reward_fn": "bench_dynamic_sampling:binary_seven", "dynamic_sampling": {"max_rounds": 6},
        "engine": {"max_tokens_per_microbatch": 2048, "optimizer": {"lr": 2e-4, "max_grad_norm": 1.0}},
    }  # fmt: skip
    run_grpo(build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()])))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def main() -> int:
    import torch

    from shardforge.algorithms.demos.demo import prepare_demo

    torch.set_num_threads(1)
    started = time.perf_counter()
    info = _common.machine_info()
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench_dynamic_sampling_") as tmp:
        assets = prepare_demo(Path(tmp) / "demo", num_eval=8)
        for r in range(ROUNDS):
            for mode, overrides in MODES.items():
                per_mode[mode] += run_mode(assets, Path(tmp) / f"{mode}{r}", overrides)

    def median(mode: str, key: str) -> float:
        return statistics.median(float(x.get(key, 0.0)) for x in per_mode[mode])

    summary = {
        mode: {
            "advantage_nonzero_frac": median(mode, "advantage_nonzero_frac"),
            "generate_s": median(mode, "generate_s"),
            "step_s": median(mode, "step_s"),
            "rounds": median(mode, "dynamic_sampling/rounds"),
            "groups_generated_per_kept": (
                sum(x.get("dynamic_sampling/groups_generated", 0.0) for x in per_mode[mode])
                / max(sum(x.get("dynamic_sampling/groups_kept", 0.0) for x in per_mode[mode]), 1.0)
            ),
            "cap_hit_steps": sum(x.get("dynamic_sampling/cap_hit", 0.0) for x in per_mode[mode]),
        }
        for mode in MODES
    }
    on, off = summary["on"], summary["off"]
    payload = {"machine": info, "rounds": ROUNDS, "steps": STEPS, "summary": summary}
    payload["seconds"] = time.perf_counter() - started
    path = _common.write_json(NAME, payload)
    print(json.dumps(payload, indent=2))
    cost = on["generate_s"] / max(off["generate_s"], 1e-9)
    _common.upsert_result_row(
        benchmark=NAME,
        metric="GRPO trained tokens with a non-zero advantage (median/step; generate s/step)",
        ours=f"{on['advantage_nonzero_frac']:.2f} ({on['generate_s']:.2f} s, {on['rounds']:.0f} rounds)",
        baseline=f"{off['advantage_nonzero_frac']:.2f} ({off['generate_s']:.2f} s)",
        ratio=f"generation x{cost:.2f}",
        target=_common.target_cell("1.0 with", on["advantage_nonzero_frac"] == 1.0),
        machine=_common.machine_label(info),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
