"""Scale-out costs (issue 21): multi-node launch overhead, automatic-restart latency, rollout-server restart.

Questions and setup (the tiny Qwen3 of `shardforge.algorithms.testing.tiny_assets`, SFT, gloo on
CPU, ``OMP_NUM_THREADS=1``, global batch 4, ``engine.max_tokens_per_microbatch=64``):

(a) Two "nodes" on localhost (two ``shardforge train --nnodes 2 --node-rank 0/1 --nproc-per-node 1``
    agents, c10d rendezvous on 127.0.0.1) vs one node (``--nproc-per-node 2``), the same world size
    and work: median step time (gap between consecutive ``metrics.jsonl`` rows, steps 3..50) of each run;
    five alternated pairs (``BENCH_SCALE_OUT_PAIRS``; one node first in even pairs, two nodes first in odd
    ones, so an order effect cancels), the ratio is the median of the paired ratios (a pair
    shares the machine's load; under load 4-8 single pairs ranged 0.74-1.45, and a steady-state window on
    a quiet machine gave 0.98-0.99, `_scale_out_cpu.py`).
    Target: ratio <= 1.05.
(c) ``--max-restarts 1``, rank 1 SIGKILLed after step 4 (``SHARDFORGE_FAULT_KILL``, checkpoints
    every 2 steps): seconds from the kill (the fault marker's mtime) to the first step logged after
    the automatic resume (agent restart, process start, imports, rendezvous, checkpoint load, one
    step). Lower is better; no target.
(d) A rollout server (the stub in ``packages/rollout/src/shardforge/rollout/testing/stub_server.py``) dies with a
    batch in flight, ``rollout.vllm.on_server_failure: restart``: seconds from the failed batch to its
    resent batch served (health check, restart, weight-version restore, resend). A real vLLM
    server's restart adds its own start-up (model load, minutes on GPUs); this is our overhead.
(b) GRPO at 2 trainer ranks, equal work (``prompts_per_step=4, group_size=4, max_new_tokens=8``,
    ``RAY_STEPS`` steps, length reward): median ``step_s`` (rollouts + update + publish) and its
    ``generate_s`` part under torchrun (colocated), ``--launcher ray`` colocated, and ``--launcher ray``
    with ``rollout.placement: disaggregated`` (1 rollout actor), in the order torchrun, Ray colocated,
    disaggregated, Ray colocated, torchrun (the two compared placements: the mean of their two runs). Ray is installed in the ``nox -s ray``
    venv only: run ``.nox/ray/bin/python benchmarks/bench_scale_out.py --ray`` (this part only; without
    ``--ray`` it is skipped). Target: Ray colocated / torchrun <= 1.10. Disaggregated on one machine
    serialises the two ranks' generate calls on one actor (and shares the cores), so its ratio shows the
    placement's cost here, not its benefit on separate devices.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _common
import yaml

from shardforge.algorithms.testing import tiny_assets
from shardforge.algorithms.testing.fault_injection import fault_env
from shardforge.rollout.testing import STUB_SERVER

NAME = "scale_out"
ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "shardforge.algorithms.cli"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
for _var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_var, None)
STEPS = 50
REPEATS = int(os.environ.get("BENCH_SCALE_OUT_PAIRS", "5"))
"""Pairs of runs for (a); each pair alternates which layout runs first (ABBA), so an order effect cancels."""


def _config(work: Path, assets: dict[str, Any], name: str, **entries: Any) -> Path:
    data = {
        "model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(work / name),
        "global_batch_size": 4, "steps": STEPS, "progress": False, "save_every": 0, "export_hf_at_end": False,
        "engine": {"max_tokens_per_microbatch": 64},
    } | entries  # fmt: skip
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("split") == "train"]


def _median_step_s(out: Path) -> float:
    times = [r["time"] for r in _rows(out)]
    return statistics.median(b - a for a, b in itertools.pairwise(times[2:]))


def _run(command: list[str], env: dict[str, str] | None = None) -> None:
    result = subprocess.run(command, env=env or ENV, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")


def two_nodes(config: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
    nodes = [
        subprocess.Popen(
            [
                *CLI,
                "train",
                "sft",
                "--config",
                str(config),
                "--nproc-per-node",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--rdzv-endpoint",
                endpoint,
            ],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 0)
    ]
    errors = [node.communicate(timeout=600)[1] for node in nodes]
    if any(node.returncode != 0 for node in nodes):
        raise RuntimeError("two-node run failed:\n" + "\n---\n".join(e[-3000:] for e in errors))


def restart_latency(work: Path, assets: dict[str, Any]) -> dict[str, float]:
    marker = work / "killed"
    config = _config(work, assets, "restart", steps=8, save_every=2)
    env = ENV | fault_env(SHARDFORGE_FAULT_KILL=f"1:4:{marker}")
    _run([*CLI, "train", "sft", "--config", str(config), "--nproc-per-node", "2", "--max-restarts", "1"], env)
    killed_at = marker.stat().st_mtime
    after = [r for r in _rows(work / "restart") if r["time"] > killed_at]
    return {"kill_to_first_step_s": after[0]["time"] - killed_at, "first_step_after_resume": after[0]["step"]}


def rollout_server_restart(work: Path) -> dict[str, float]:
    from shardforge.rollout.config import VLLMOptions
    from shardforge.rollout.types import SamplingParams
    from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

    stub, marker = STUB_SERVER, work / "die"

    class StubEngine(VLLMServerRolloutEngine):  # the stub instead of `vllm serve`, as in the tests
        def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
            return [sys.executable, str(stub), "--port", str(port), "--die-once", str(marker)]

    tokenizer = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: "")
    prompts, params = [[5, 6, 7], [8, 9], [10]], SamplingParams(n=3, max_new_tokens=4, seed=7)
    options = VLLMOptions(mode="server", on_server_failure="restart", health_timeout_s=2.0, request_timeout_s=30.0)
    engine = StubEngine(work, tokenizer, weights_root=work / "w", options=options, log_file=work / "stub.log")
    try:
        engine.update_weights(1)
        began = time.perf_counter()
        engine.generate(prompts, params)
        healthy = time.perf_counter() - began
        marker.touch()
        began = time.perf_counter()
        engine.generate(prompts, params)  # dies in flight, restarts, resends
        recovered = time.perf_counter() - began
        assert engine.pop_stats()["rollout_server/restarts"] == 1.0
    finally:
        engine.shutdown(grace_s=5.0)
    return {"healthy_batch_s": healthy, "batch_with_restart_s": recovered}


RAY_STEPS = 8
LENGTH_REWARD = "def reward(prompt, response, reference):\n    return float(len(response))\n"


def _grpo_config(work: Path, assets: dict[str, Any], name: str, **entries: Any) -> Path:
    data = {
        "model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(work / name),
        "steps": RAY_STEPS, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8, "progress": False,
        "reward_fn": "length_reward:reward", "save_every": 0, "export_hf_at_end": False, "eval_every": 0,
        "engine": {"max_tokens_per_microbatch": 128},
    } | entries  # fmt: skip
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def ray_grpo(work: Path, assets: dict[str, Any]) -> dict[str, dict[str, float]]:
    """(b): median step_s / generate_s (steps 2..) of each placement; torchrun and Ray colocated twice each."""
    (work / "length_reward.py").write_text(LENGTH_REWARD)
    env = ENV | {"PYTHONPATH": os.pathsep.join(filter(None, [str(work), ENV.get("PYTHONPATH")]))}
    env |= {"RAY_USAGE_STATS_ENABLED": "0"}
    placements = {
        "torchrun": ((), {}),
        "ray_colocated": (("--launcher", "ray"), {}),
        "ray_disaggregated": (("--launcher", "ray"), {"rollout.placement": "disaggregated"}),
    }
    # palindromic order (torchrun, Ray colocated, disaggregated, Ray colocated, torchrun): a load that drifts
    # linearly during the runs hits torchrun and Ray colocated alike; each of those two is the mean of its runs
    order = ["torchrun", "ray_colocated", "ray_disaggregated", "ray_colocated", "torchrun"]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in placements}
    for index, name in enumerate(order):
        launch, entries = placements[name]
        config = _grpo_config(work, assets, f"{name}{index}", **entries)
        started, load = time.perf_counter(), os.getloadavg()[0]
        _run([*CLI, "train", "grpo", "--config", str(config), "--nproc-per-node", "2", *launch], env)
        rows = _rows(work / f"{name}{index}")[1:]  # step 1 pays the first-call warm-up
        runs[name].append({
            "step_s": statistics.median(r["step_s"] for r in rows),
            "generate_s": statistics.median(r.get("generate_s", float("nan")) for r in rows),
            "wall_s": time.perf_counter() - started, "load_1min": load,
        })  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for name, results in runs.items():
        out[name] = {key: statistics.fmean(r[key] for r in results) for key in results[0]}
        out[name]["step_s_runs"] = [r["step_s"] for r in results]  # type: ignore[assignment]
    return out


def main_ray() -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = ray_grpo(work, tiny_assets(work / "assets", max_operand=9, num_eval=10))
    load = (load_before, os.getloadavg()[0])
    info = _common.machine_info()
    base = result["torchrun"]["step_s"]
    ratios = {name: row["step_s"] / base for name, row in result.items()}
    payload = {"ray_grpo": result, "ratios_vs_torchrun": ratios, "steps": RAY_STEPS, "load_1min": load, "machine": info}
    path = _common.write_json(NAME + "_ray", payload)
    print(json.dumps(payload, indent=2), f"\nwrote {path}")
    _common.upsert_result_row(
        benchmark="scale_out_ray (GRPO, 2 ranks: Ray colocated [Ray disaggregated, 1 rollout actor] vs torchrun)",
        metric=(
            f"median GRPO step_s, tiny Qwen3, gloo, equal work, mean of 2 runs (torchrun, Ray colocated; palindromic "
            f"order) [1 run] (1-min load {load[0]:.1f}-{load[1]:.1f})"
        ),
        ours=f"{result['ray_colocated']['step_s']:.3f} [{result['ray_disaggregated']['step_s']:.3f}]",
        baseline=f"{base:.3f} (torchrun)",
        ratio=f"{ratios['ray_colocated']:.3f} [{ratios['ray_disaggregated']:.3f}]",
        target=_common.target_cell("<= 1.10", ratios["ray_colocated"] <= 1.10),
        machine=_common.machine_label(info),
    )


def main() -> None:
    if "--ray" in sys.argv[1:]:
        main_ray()
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets = tiny_assets(work / "assets", max_operand=9, num_eval=10)
        single, multi = [], []
        for i in range(REPEATS):  # alternated: load from other jobs on the machine hits both sides
            for layout in ("single", "multi") if i % 2 == 0 else ("multi", "single"):  # ABBA: order cancels
                config = _config(work, assets, f"{layout}{i}")
                if layout == "single":
                    _run([*CLI, "train", "sft", "--config", str(config), "--nproc-per-node", "2"])
                else:
                    two_nodes(config)
            single.append(_median_step_s(work / f"single{i}"))
            multi.append(_median_step_s(work / f"multi{i}"))
        single_s, multi_s = statistics.median(single), statistics.median(multi)
        pairs = [m / s for s, m in zip(single, multi, strict=True)]
        restart = restart_latency(work, assets)
        server = rollout_server_restart(work)
    ratio = statistics.median(pairs)
    info = _common.machine_info()
    payload = {"single_node_step_s": single_s, "two_node_step_s": multi_s, "single_runs": single, "multi_runs": multi, "pair_ratios": pairs, "ratio": ratio,
               "load_1min": os.getloadavg()[0], "steps": STEPS,
               "restart": restart, "rollout_server": server, "ray": "see scale_out_ray (--ray)",
               "machine": info}  # fmt: skip
    path = _common.write_json(NAME, payload)
    print(json.dumps(payload, indent=2), f"\nwrote {path}")
    _common.upsert_result_row(
        benchmark="scale_out (two localhost nodes x 1 rank vs one node x 2, SFT)",
        metric=(
            "median SFT step s, tiny Qwen3, gloo [kill-to-first-step-after-resume s, --max-restarts 1; "
            "rollout-server death-to-batch-served s with restart, stub server]"
        ),
        ours=f"{multi_s:.3f} [{restart['kill_to_first_step_s']:.1f}; {server['batch_with_restart_s']:.2f}]",
        baseline=f"{single_s:.3f} (one node)",
        ratio=f"{ratio:.3f} (pairs {min(pairs):.2f}-{max(pairs):.2f}; ratio of the {len(pairs)}-run medians {multi_s / single_s:.3f})",
        target=_common.target_cell("<= 1.05", ratio <= 1.05),
        machine=_common.machine_label(info),
    )


if __name__ == "__main__":
    main()
