"""The `shardforge` command line.

    shardforge [--log-level INFO] train sft|rm|ppo|grpo --config examples/sft_tiny.yaml [--nproc-per-node N] key=value ...
    shardforge list        (every registry: trainers, losses, estimators, rewards, rollout engines, ...)
    shardforge demo [--out outputs/demo] [--nproc-per-node 2] [--steps 600]
    shardforge demo-rl [--out outputs/demo_rl] [--nproc-per-node 2] [--sft-steps 450] [--grpo-steps N]
    shardforge plan llama3-70b --world-size 1024 --seq-len 8192 --memory 80GiB [--ac full] [--json] ...

``key=value`` overrides use dotted paths into the config (``engine.optimizer.lr=1e-3``).
With ``--nproc-per-node N > 1`` outside torchrun, the command relaunches itself through
``torch.distributed.run``; under torchrun it runs as one rank. Trainers are looked up by name
in `shardforge.algorithms.trainers.TRAINERS`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

from shardforge.algorithms.log import get_logger, setup_logging
from shardforge.algorithms.trainers import TRAINERS

__all__ = ["main"]

log = get_logger(__name__)

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Modules that define registries; `shardforge list` imports them (none imports vLLM).
_REGISTRY_MODULES = (
    "shardforge.algorithms.trainers",
    "shardforge.algorithms.objectives",
    "shardforge.algorithms.rollout.factory",
    "shardforge.algorithms.rollout.reward_functions",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardforge", description="Distributed LLM training on HF models.")
    parser.add_argument("--log-level", type=str.upper, choices=_LOG_LEVELS, default="INFO", help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model", description="Train with a YAML config plus overrides.")
    train.add_argument("algorithm", help=f"a registered trainer: {TRAINERS.names()} (see `shardforge list`)")
    train.add_argument(
        "--log-level", type=str.upper, choices=_LOG_LEVELS, default=argparse.SUPPRESS, help="logging level"
    )
    train.add_argument("--config", required=True, help="YAML config file")
    train.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine")
    train.epilog = "Any further key=value arguments override config entries, e.g. engine.optimizer.lr=1e-3"
    demo = sub.add_parser("demo", help="run the end-to-end CPU demo")
    demo.add_argument("--out", default="outputs/demo", help="output directory")
    demo.add_argument("--nproc-per-node", type=int, default=2, help="FSDP ranks")
    demo.add_argument("--steps", type=int, default=600, help="SFT steps")
    demo_rl = sub.add_parser("demo-rl", help="run the CPU RL demo: a short SFT, then GRPO")
    demo_rl.add_argument("--out", default="outputs/demo_rl", help="output directory")
    demo_rl.add_argument("--nproc-per-node", type=int, default=2, help="FSDP ranks")
    demo_rl.add_argument("--sft-steps", type=int, default=450, help="SFT steps before GRPO")
    demo_rl.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: demo_grpo.yaml)")
    sub.add_parser("list", help="list every registry (trainers, losses, estimators, ...) with its names")
    from shardforge.algorithms.plan.report import add_plan_parser

    add_plan_parser(sub)
    return parser


def _relaunch(nproc: int) -> int:
    """Re-run this exact command under torchrun with ``nproc`` ranks."""
    args = [a for a in sys.argv[1:]]
    cleaned: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--nproc-per-node":
            skip = True
            continue
        if arg.startswith("--nproc-per-node="):
            continue
        cleaned.append(arg)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "shardforge.algorithms.cli", *cleaned,
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(command, env=env)


def _train(args: argparse.Namespace) -> int:
    from shardforge.algorithms.config_io import apply_overrides, build_config, load_yaml

    if args.algorithm not in TRAINERS:
        raise SystemExit(f"unknown algorithm {args.algorithm!r}; available: {TRAINERS.names()} (see `shardforge list`)")
    if args.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
        return _relaunch(args.nproc_per_node)
    trainer = TRAINERS.get(args.algorithm)
    data = apply_overrides(load_yaml(args.config), args.overrides)
    summary = trainer.run(build_config(trainer.config_cls, data))
    log.info("done: %s", summary)
    from shardforge.mesh import destroy_distributed

    destroy_distributed()
    return 0


def _list() -> int:
    """Print every registry with each name and its one-line description (stdout, on purpose)."""
    from shardforge.algorithms.registry import all_registries

    for module in _REGISTRY_MODULES:
        importlib.import_module(module)
    lines: list[str] = []
    for registry in sorted(all_registries(), key=lambda r: r.kind):
        lines.append(f"{registry.kind}:")
        entries = list(registry.describe())
        width = max((len(name) for name, _ in entries), default=0)
        lines.extend(f"  {name:<{width}}  {doc}".rstrip() for name, doc in entries)
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if "=" not in a or a.startswith("-")]
    if bad or (extra and args.command != "train"):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)} (overrides look like key=value)")
    args.overrides = extra
    setup_logging(args.log_level)
    if args.command == "list":
        return _list()
    if args.command == "train":
        return _train(args)
    if args.command == "demo":
        from shardforge.algorithms.demos.demo import run_demo

        run_demo(args.out, nproc=args.nproc_per_node, steps=args.steps)
        return 0
    if args.command == "demo-rl":
        from shardforge.algorithms.demos.demo_rl import run_rl_demo

        run_rl_demo(args.out, nproc=args.nproc_per_node, sft_steps=args.sft_steps, grpo_steps=args.grpo_steps)
        return 0
    if args.command == "plan":
        from shardforge.algorithms.plan.report import run_plan

        return run_plan(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
