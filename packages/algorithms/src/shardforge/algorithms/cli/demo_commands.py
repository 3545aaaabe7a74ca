"""The demo subcommands of `shardforge`: demo, demo-rl, demo-distill, demo-agent, demo-vlm (their parsers and runs)."""

from __future__ import annotations

import argparse
from typing import Any

from shardforge.core.log import get_logger

__all__ = ["add_demo_parsers", "run_demo_command"]

log = get_logger(__name__)


def add_demo_parsers(sub: Any) -> None:
    """Add the demo subcommands to ``sub`` (the `shardforge` parser's subparsers)."""
    demo = sub.add_parser("demo", help="run the end-to-end CPU demo")
    demo.add_argument("--out", default="outputs/demo", help="output directory")
    demo.add_argument("--nproc-per-node", type=int, default=2, help="FSDP ranks")
    demo.add_argument("--steps", type=int, default=1000, help="SFT steps")
    demo.add_argument(
        "--prepare-only", action="store_true", help="only write the tiny model, tokenizer and data under --out"
    )
    demo_rl = sub.add_parser("demo-rl", help="run the CPU RL demo: a short SFT, then GRPO")
    demo_rl.add_argument("--out", default="outputs/demo_rl", help="output directory")
    demo_rl.add_argument("--nproc-per-node", type=int, default=2, help="FSDP ranks")
    demo_rl.add_argument("--sft-steps", type=int, default=450, help="SFT steps before GRPO")
    demo_rl.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: demo_grpo.yaml)")
    demo_kd = sub.add_parser("demo-distill", help="run the CPU distillation demo: a small student from the SFT model")
    demo_kd.add_argument("--out", default="outputs/demo_distill", help="output directory")
    demo_kd.add_argument("--nproc-per-node", type=int, default=2, help="FSDP ranks")
    demo_kd.add_argument("--teacher-steps", type=int, default=1000, help="SFT steps of the teacher")
    demo_kd.add_argument("--student-steps", type=int, default=1000, help="SFT steps of the student before the split")
    demo_kd.add_argument("--extra-steps", type=int, default=100, help="steps of each continuation (SFT / distill)")
    demo_kd.add_argument("--teacher", default=None, help="reuse this teacher HF dir (e.g. an earlier run's teacher/hf)")
    demo_kd.add_argument("--student-hidden", type=int, default=128, help="student hidden size")
    demo_kd.add_argument("--student-layers", type=int, default=4, help="student decoder layers")
    demo_kd.add_argument(
        "--distill-loss", default=None, help="distill_loss of the distillation stage (default: demo_distill.yaml's)"
    )
    demo_kd.add_argument(
        "--distill-set", action="append", default=[], metavar="KEY=VALUE",
        help="extra override of the distillation stage (repeatable), e.g. engine.optimizer.lr=5e-4",
    )  # fmt: skip
    demo_agent = sub.add_parser(
        "demo-agent", help="run the CPU agent demo: SFT on calculator tool-call traces, then GRPO with tool_use"
    )
    demo_agent.add_argument("--out", default="outputs/demo_agent", help="output directory")
    demo_agent.add_argument("--nproc-per-node", type=int, default=2, help="FSDP ranks")
    demo_agent.add_argument(
        "--sft-steps", type=int, default=None, help="fixed SFT steps (default: stop on validation success, --sft-stop)"
    )
    demo_agent.add_argument(
        "--sft-stop", action="append", default=[], metavar="KEY=VALUE",
        help="override of the SFT stop rule (demo_agent_sft_stop.yaml; repeatable), e.g. target=0.25 max_steps=400",
    )  # fmt: skip
    demo_agent.add_argument("--sft-only", action="store_true", help="stop after the SFT stage")
    demo_agent.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: demo_agent_grpo.yaml)")
    demo_agent.add_argument("--seed", type=int, default=0, help="seed of the model, data, SFT and GRPO")
    demo_agent.add_argument(
        "--openai-agent", action="store_true",
        help="GRPO trains an agent written against the openai SDK only (demos/openai_calculator_agent.py) through "
        "the OpenAI-compatible endpoint (workflow.name=agent) instead of the tool_use workflow",
    )  # fmt: skip
    demo_vlm = sub.add_parser(
        "demo-vlm",
        help="run the CPU vision-language demo: a tiny Qwen2.5-VL learns the colour of a square (SFT, then GRPO)",
    )
    demo_vlm.add_argument("--out", default="outputs/demo_vlm", help="output directory")
    demo_vlm.add_argument("--nproc-per-node", type=int, default=2, help="FSDP ranks")
    demo_vlm.add_argument("--steps", type=int, default=None, help="SFT steps (default: demo_vlm_sft.yaml)")
    demo_vlm.add_argument(
        "--grpo-steps", type=int, default=None, help="GRPO steps (default: demo_vlm_grpo.yaml; 0: SFT only)"
    )
    demo_vlm.add_argument(
        "--prepare-only",
        action="store_true",
        help="only write the tiny VLM and the image data (examples/sft_vlm_tiny.yaml, examples/grpo_vlm_tiny.yaml)",
    )


def run_demo_command(args: argparse.Namespace) -> int:
    """Run the demo subcommand ``args.command``."""
    if args.command == "demo":
        from shardforge.algorithms.demos.demo import prepare_demo, run_demo

        if args.prepare_only:
            assets = prepare_demo(args.out)
            log.info("tiny model + tokenizer: %s; data: %s, %s", assets["model"], assets["train"], assets["eval"])
            return 0
        run_demo(args.out, nproc=args.nproc_per_node, steps=args.steps)
        return 0
    if args.command == "demo-distill":
        from shardforge.algorithms.demos.demo_distill import run_distill_demo

        run_distill_demo(
            args.out, nproc=args.nproc_per_node, teacher_steps=args.teacher_steps,
            student_steps=args.student_steps, extra_steps=args.extra_steps, teacher_dir=args.teacher,
            student_hidden=args.student_hidden, student_layers=args.student_layers, distill_loss=args.distill_loss,
            distill_overrides=args.distill_set,
        )  # fmt: skip
        return 0
    if args.command == "demo-rl":
        from shardforge.algorithms.demos.demo_rl import run_rl_demo

        run_rl_demo(args.out, nproc=args.nproc_per_node, sft_steps=args.sft_steps, grpo_steps=args.grpo_steps)
        return 0
    if args.command == "demo-agent":
        from shardforge.algorithms.demos.demo_agent import load_sft_stop_rule, run_agent_demo

        if args.sft_steps is not None and args.sft_stop:
            raise SystemExit("demo-agent: give --sft-steps (a fixed count) or --sft-stop (the stop rule), not both")
        run_agent_demo(
            args.out, nproc=args.nproc_per_node, sft_steps=args.sft_steps, sft_stop=load_sft_stop_rule(args.sft_stop),
            grpo_steps=args.grpo_steps, seed=args.seed, sft_only=args.sft_only, openai_agent=args.openai_agent,
        )  # fmt: skip
        return 0
    if args.command == "demo-vlm":
        from shardforge.algorithms.demos.demo_vlm import prepare_vlm_demo, run_vlm_demo

        if args.prepare_only:
            made = prepare_vlm_demo(args.out)
            log.info(
                "tiny VLM + tokenizer + image processor: %s; data: %s, %s", made["model"], made["train"], made["eval"]
            )
            return 0
        run_vlm_demo(args.out, nproc=args.nproc_per_node, steps=args.steps, grpo_steps=args.grpo_steps)
        return 0
    raise AssertionError(args.command)
