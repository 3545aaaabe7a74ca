"""GRPO step overheads at world 1: old log-probs from the training forward (``reuse_training_logprobs``)
and in-memory weight publishing to the embedded HF engine (``rollout.publish_in_memory``) vs the old path
(a recompute forward + a weight-sync version written to disk and read back).

Same demo Qwen3 (3.2M weights), prompts, seeds and sampling in both modes; the two modes run
alternately (A, B, A, B, ...) in this process, one thread, so both see the same machine load.
Reports the median per-step ``logprob_forward_s``, ``weight_sync_s`` and ``step_s`` of each mode
(first step of each run dropped) and the per-round ratios of step time.

Run: ``python benchmarks/bench_rl_overheads.py [--layout d2]`` from the repo root (a few minutes).
With ``--layout d2`` both modes run on two ranks of a rank pool and differ only in ``rollout.publish_in_memory``
(the full weights gathered to each rank in memory vs one disk version read back by every rank).
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

NAME = "grpo_overheads"
ROUNDS = 3
STEPS = 4
MODES = {
    "new": {},
    "old": {"reuse_training_logprobs": "false", "rollout.publish_in_memory": "false"},
}
MODES_MULTI_RANK = {"new": {}, "old": {"rollout.publish_in_memory": "false"}}


def run_mode(assets: dict[str, Any], out: Path, overrides: dict[str, str], layout: str = "d1") -> list[dict[str, Any]]:
    import torch.distributed as dist

    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    data = {
        "model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(out),
        "layout": layout, "steps": STEPS, "prompts_per_step": 32, "group_size": 8, "max_new_tokens": 6,
        "temperature": 0.7, "progress": False, "save_every": 0, "resume": "never", "export_hf_at_end": False,
        "engine": {"max_tokens_per_microbatch": 2048, "optimizer": {"lr": 2e-4, "max_grad_norm": 1.0}},
    }  # fmt: skip
    run_grpo(build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()])))
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"][1:]


def main() -> int:
    import argparse

    import torch

    from shardforge.algorithms.demos.demo import prepare_demo
    from shardforge.mesh import ParallelDims

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", default="d1", help="d1 (default) or a multi-rank layout such as d2")
    layout = parser.parse_args().layout
    dims = ParallelDims.parse(layout)
    world = dims.pp * dims.dp_replicate * max(dims.dp_shard, 1) * dims.cp * dims.tp
    modes = MODES if world == 1 else MODES_MULTI_RANK
    name = NAME if world == 1 else f"{NAME}_{layout}"
    torch.set_num_threads(1)
    started = time.perf_counter()
    info = _common.machine_info()
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench_rl_overheads_") as tmp:
        assets = prepare_demo(Path(tmp) / "demo", num_eval=8)
        for r in range(ROUNDS):
            medians = {}
            for mode, overrides in modes.items():
                if world == 1:
                    rows = run_mode(assets, Path(tmp) / f"{mode}{r}", overrides)
                else:
                    from shardforge.mesh.testing import get_rank_pool

                    out = Path(tmp) / f"{mode}{r}"
                    rows = get_rank_pool(world).run(run_mode, assets, out, overrides, layout, timeout_s=900)[0]
                per_mode[mode] += rows
                medians[mode] = statistics.median(x["step_s"] for x in rows)
            ratios.append(medians["new"] / medians["old"])
    summary = {
        mode: {k: statistics.median(x[k] for x in rows) for k in ("step_s", "logprob_forward_s", "weight_sync_s")}
        for mode, rows in per_mode.items()
    }
    payload = {
        "machine": info,
        "layout": layout,
        "modes": modes,
        "rounds": ROUNDS,
        "steps": STEPS,
        "summary": summary,
        "step_ratio_per_round": ratios,
    }
    payload["seconds"] = time.perf_counter() - started
    path = _common.write_json(name, payload)
    new, old = summary["new"], summary["old"]
    print(json.dumps(payload, indent=2))
    _common.upsert_result_row(
        benchmark=name,
        metric=f"GRPO s/step, {layout} (median; logprob forward + weight sync)"
        + ("" if world == 1 else ": rollout.publish_in_memory true vs false"),
        ours=f"{new['step_s']:.3f} ({new['logprob_forward_s']:.3f} + {new['weight_sync_s']:.3f})",
        baseline=f"{old['step_s']:.3f} ({old['logprob_forward_s']:.3f} + {old['weight_sync_s']:.3f})",
        ratio=f"{statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})",
        target=_common.target_cell("< 1", statistics.median(ratios) < 1),
        machine=_common.machine_label(info),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
