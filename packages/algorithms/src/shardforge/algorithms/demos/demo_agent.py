"""The agent demo: a tiny Qwen3 learns to add 3-digit numbers with the ``calculator`` tool.

It cannot add in its head (it never sees an answer it did not get from the tool). A short SFT on
tool-call traces (HF chat rows with ``tool_calls`` and ``tool`` messages, rendered by a Qwen3-style
template with tools) teaches the call format; GRPO with ``workflow.name=tool_use`` then trains on its
own episodes (call the tool, read the result, answer). Both stages run with FSDP on ``nproc`` CPU
ranks through ``torchrun``; held-out success (greedy episodes) is measured before SFT, after SFT
(GRPO's first eval) and during/after GRPO, with the tool-call validity rate. SFT stops when greedy
success on a validation split reaches a target (demos/agent_sft_stop.py): where a fixed step count
ends differs too much between seeds for GRPO.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shardforge.algorithms.demos.agent_sft_stop import SFTStopRule, train_until_success

__all__ = ["load_sft_stop_rule", "make_tool_data", "run_agent_demo"]

logger = logging.getLogger(__name__)

OPENAI_AGENT_OVERRIDES = [
    "workflow.name=agent", "workflow.agent.run=shardforge.algorithms.demos.openai_calculator_agent:run",
    "workflow.agent.timeout_s=120", "workflow.max_failed_fraction=0.25",
]  # fmt: skip
"""GRPO's workflow in ``demo-agent --openai-agent``: the openai-SDK agent through the endpoint."""


def _torchrun(nproc: int, command: list[str], config: Path, overrides: list[str]) -> None:
    """``shardforge <command> --config <config> <overrides>`` on ``nproc`` CPU ranks."""
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "shardforge.algorithms.cli", *command, "--config", str(config), *overrides,
    ]  # fmt: skip
    logger.info(f"{' '.join(command)} on {nproc} CPU ranks: {' '.join(argv[2:])}")
    subprocess.run(argv, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def tool_names_template() -> str:
    """Qwen3's tool template listing tools by name: Qwen3's own lists each tool's JSON schema in the system turn
    (~230 characters for the calculator), which on CPU would be 2/3 of every tiny sequence."""
    from shardforge.algorithms.testing import QWEN3_TOOL_TEMPLATE

    template = QWEN3_TOOL_TEMPLATE.replace("{{- tool | tojson }}", "{{- tool.function.name }}")
    assert template != QWEN3_TOOL_TEMPLATE
    return template


def make_tool_data(
    out_dir: str | Path, *, num_sft: int, num_eval: int, num_rl: int, seed: int = 0, num_val: int = 0
) -> dict[str, Path]:
    """Disjoint 3-digit additions: ``sft.jsonl`` (tool-call traces), ``train.jsonl`` / ``eval.jsonl``
    (prompt + reference answer, for GRPO and the held-out evals) and ``val.jsonl`` (``num_val`` prompts
    for the SFT stop rule; drawn last, so the other splits do not depend on it)."""
    from shardforge.rollout.workflows.tools import calculator, tool_schema

    rng = random.Random(seed)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < num_sft + num_eval + num_rl + num_val:
        pairs[(rng.randint(100, 999), rng.randint(100, 999))] = None
    ordered = list(pairs)
    held_out, sft = ordered[:num_eval], ordered[num_eval : num_eval + num_sft]
    rl, val = ordered[num_eval + num_sft : num_eval + num_sft + num_rl], ordered[num_eval + num_sft + num_rl :]
    tools = [tool_schema(calculator)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "sft.jsonl").open("w") as handle:
        for a, b in sft:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}}
            messages = [
                {"role": "user", "content": f"{a}+{b}="},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": calculator(f"{a}+{b}")},
                {"role": "assistant", "content": str(a + b)},
            ]
            handle.write(json.dumps({"messages": messages, "tools": tools}) + "\n")
    for name, rows in (("train", rl), ("eval", held_out), ("val", val)):
        with (out / f"{name}.jsonl").open("w") as handle:
            for a, b in rows:
                handle.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")
    return {name: out / f"{name}.jsonl" for name in ("sft", "train", "eval", "val")}


def load_sft_stop_rule(overrides: list[str] | None = None) -> SFTStopRule:
    """``demo_agent_sft_stop.yaml`` with ``KEY=VALUE`` overrides (a bad key or value is a clear error)."""
    from shardforge.algorithms.config_io import apply_overrides, build_config, load_yaml

    data = apply_overrides(load_yaml(Path(__file__).parent / "demo_agent_sft_stop.yaml"), overrides or [])
    return build_config(SFTStopRule, data, where="sft stop rule (demo_agent_sft_stop.yaml / --sft-stop)")


def _evals(metrics_file: Path) -> list[dict[str, Any]]:
    from shardforge.algorithms.loggers import read_metrics

    return read_metrics(metrics_file, "eval")


def plot_agent(metrics_file: Path, png: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shardforge.algorithms.loggers import read_metrics

    train, evals = read_metrics(metrics_file, "train"), _evals(metrics_file)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [r["step"] for r in train], [r["reward_mean"] for r in train], alpha=0.5, label="mean reward of the episodes"
    )
    ax.plot([r["step"] for r in evals], [r["success@1"] for r in evals], "o-", label="held-out success@1 (greedy)")
    ax.plot([r["step"] for r in evals], [r.get("tool_call_valid_rate", 0.0) for r in evals], "s--",
            label="held-out tool-call validity")  # fmt: skip
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"tiny Qwen3 + calculator tool, GRPO tool_use (FSDP)\n{note}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def run_agent_demo(
    out_dir: str | Path = "outputs/demo_agent",
    *,
    nproc: int = 2,
    sft_steps: int | None = None,
    sft_stop: SFTStopRule | None = None,
    grpo_steps: int | None = None,
    seed: int = 0,
    held_out: int = 400,
    sft_only: bool = False,
    openai_agent: bool = False,
) -> dict[str, Any]:
    """Prepare, evaluate the base model, SFT on traces, GRPO with tool_use (evaluating as it goes), plot.

    SFT runs ``sft_steps`` steps when given, else until the stop rule ``sft_stop`` (default:
    ``demo_agent_sft_stop.yaml``) says so; ``sft_only`` ends the demo after SFT. With ``openai_agent`` GRPO
    (training and held-out evals) runs `openai_calculator_agent.py`, an agent written against the openai SDK
    only, through the OpenAI-compatible endpoint (``workflow.name: agent``) instead of the tool_use workflow:
    the same task, tool, prompts and chat template."""
    from shardforge.algorithms.testing import tiny_chat_assets

    out = Path(out_dir)
    started = time.time()
    assets = tiny_chat_assets(out / "assets", seed=seed, hidden=128, layers=2, chat_template=tool_names_template())
    rule = sft_stop or load_sft_stop_rule()
    data = make_tool_data(
        out / "data", num_sft=512, num_eval=held_out, num_rl=2000, seed=seed, num_val=rule.val_prompts
    )
    here = Path(__file__).parent
    sft_dir, grpo_dir, base_dir = out / "sft", out / "grpo", out / "eval_base"
    _torchrun(nproc, ["eval"], here / "demo_agent_eval.yaml", [
        f"model={assets['model']}", f"eval_files=[{data['eval']}]", f"output_dir={base_dir}", f"layout=d{nproc}",
    ])  # fmt: skip
    base = json.loads((base_dir / "eval_results.json").read_text())["results"]["eval"]

    def train_to(steps: int, total: int) -> None:  # resumes from sft_dir's checkpoint: chunks = one run
        _torchrun(nproc, ["train", "sft"], here / "demo_agent_sft.yaml", [
            f"model={assets['model']}", f"train_file={data['sft']}", f"output_dir={sft_dir}", f"steps={steps}",
            f"layout=d{nproc}", f"engine.scheduler.total_steps={total}", f"seed={seed}", f"save_every={total}",
            "keep_last=2",
        ])  # fmt: skip

    def success_at(steps: int) -> float:
        val_dir = sft_dir / f"val{len(list(sft_dir.glob('val*'))):02d}_step{steps}"  # a step may come twice
        _torchrun(nproc, ["eval"], here / "demo_agent_eval.yaml", [
            f"model={sft_dir / 'hf'}", f"eval_files=[{data['val']}]", f"output_dir={val_dir}", f"layout=d{nproc}",
        ])  # fmt: skip
        return float(json.loads((val_dir / "eval_results.json").read_text())["results"]["val"]["success@1"])

    def rewind(steps: int) -> None:  # the next train_to resumes from the checkpoint at ``steps``
        for checkpoint in (sft_dir / "checkpoints").glob("step_*"):
            if int(checkpoint.name.removeprefix("step_")) > steps:
                shutil.rmtree(checkpoint)

    shutil.rmtree(sft_dir, ignore_errors=True)  # no checkpoint of an earlier demo run may be resumed
    if sft_steps is not None:
        train_to(sft_steps, sft_steps)
        stopped: dict[str, Any] = {"steps": sft_steps, "reason": "fixed"}
    else:
        stopped = train_until_success(rule, lambda step: train_to(step, rule.max_steps), success_at, rewind).to_dict()
        sft_steps = int(stopped["steps"])
    if sft_only:
        result = {"sft": stopped, "base_success@1": base["success@1"], "seed": seed, "ranks": nproc,
                  "minutes": (time.time() - started) / 60}  # fmt: skip
        (out / "demo_agent_result.json").write_text(json.dumps(result, indent=2))
        logger.info(f"SFT only: {stopped}; total {result['minutes']:.1f} min")
        return result
    overrides = [
        f"model={sft_dir / 'hf'}", f"train_file={data['train']}", f"eval_file={data['eval']}",
        f"output_dir={grpo_dir}", f"layout=d{nproc}", "resume=never", f"seed={seed}", f"eval_size={held_out}",
    ]  # fmt: skip
    if grpo_steps is not None:
        overrides.append(f"steps={grpo_steps}")
    if openai_agent:
        overrides += OPENAI_AGENT_OVERRIDES
    _torchrun(nproc, ["train", "grpo"], here / "demo_agent_grpo.yaml", overrides)
    evals = _evals(grpo_dir / "metrics.jsonl")
    after_sft, after_grpo = evals[0], evals[-1]
    png = out / "agent_curve.png"
    note = (
        f"held-out success {base['success@1']:.0%} (base) -> {after_sft['success@1']:.0%} (SFT) -> "
        f"{after_grpo['success@1']:.0%} (GRPO{', openai-SDK agent' if openai_agent else ''}), {nproc} ranks"
    )
    plot_agent(grpo_dir / "metrics.jsonl", png, note)
    keys = ("success@1", "tool_call_valid_rate", "tool_calls_mean", "turns_mean", "reward_per_turn")
    result = {
        "sft_steps": sft_steps,
        "sft": stopped,
        "grpo_steps": int(after_grpo["step"]),
        "base": {k: base.get(k) for k in keys},
        "after_sft": {k: after_sft.get(k) for k in keys},
        "after_grpo": {k: after_grpo.get(k) for k in keys},
        "held_out_prompts": held_out,
        "seed": seed,
        "ranks": nproc,
        "workflow": "agent (openai SDK)" if openai_agent else "tool_use",
        "curve": str(png),
        "minutes": (time.time() - started) / 60,
    }
    (out / "demo_agent_result.json").write_text(json.dumps(result, indent=2))
    if openai_agent:  # the endpoint records tokens, not the agent's tool calls: no validity rate to report
        logger.info(note)
    else:
        logger.info(f"{note}; tool-call validity {after_sft.get('tool_call_valid_rate', 0):.0%} -> "
                    f"{after_grpo.get('tool_call_valid_rate', 0):.0%}")  # fmt: skip
    logger.info(f"curve: {png}; total {result['minutes']:.1f} min")
    if after_grpo["success@1"] <= after_sft["success@1"]:
        raise SystemExit("[demo-agent] GRPO did not raise held-out success")
    return result
