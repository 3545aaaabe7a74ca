"""The `shardforge` command line.

    shardforge [--log-level INFO] [--debug] train sft|rm|ppo|grpo --config examples/sft_tiny.yaml [--nproc-per-node N] key=value ...
    shardforge train sft --config c.yaml --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node01:29400
    shardforge train grpo --config c.yaml --nproc-per-node 2 --launcher ray [--ray-address auto]
    shardforge train sft --help   (every config key with its type, default and description)
    shardforge list        (every registry: trainers, losses, estimators, rewards, rollout engines, ...)
    shardforge config-reference [--out docs/configuration.md] [--check]   (every config key, as markdown)
    shardforge prepare-tiny [--out outputs]   (the models and data of every examples/*_tiny.yaml)
    shardforge demo [--out outputs/demo] [--nproc-per-node 2] [--steps 1000] [--prepare-only]
    shardforge demo-rl [--out outputs/demo_rl] [--nproc-per-node 2] [--sft-steps 450] [--grpo-steps N]
    shardforge demo-agent [--out outputs/demo_agent] [--nproc-per-node 2] [--sft-steps N | --sft-stop KEY=VALUE]
                          [--sft-only] [--grpo-steps N] [--seed S]
    shardforge demo-vlm [--out outputs/demo_vlm] [--nproc-per-node 2] [--steps N] [--grpo-steps N] [--prepare-only]
    shardforge plan llama3-70b --world-size 1024 --seq-len 8192 --memory 80GiB [--ac full] [--json] ...

``key=value`` overrides use dotted paths into the config (``engine.optimizer.lr=1e-3``).
Before any rank starts, the launching process builds the config and checks the layout against
``--nproc-per-node``, the model paths, the data files and the output directory
(`shardforge.algorithms.cli.preflight`). With ``--nproc-per-node N > 1`` outside torchrun, the command
then relaunches itself through torchrun's agent in this process (`shardforge.algorithms.launch.torchrun`:
signals reach every rank); under torchrun it runs as one rank. Errors are one line on rank 0
(``--debug``: tracebacks). Trainers are looked up by name
in `shardforge.algorithms.trainers.TRAINERS`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

from shardforge.algorithms.trainers import TRAINERS, TrainerSpec
from shardforge.algorithms.trainers.run.startup_gc import end_startup_gc, paused_gc
from shardforge.core.log import get_logger, setup_logging

__all__ = ["main"]

log = get_logger(__name__)

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Modules that define registries; `shardforge list` imports them (none imports vLLM).
_REGISTRY_MODULES = (
    "shardforge.algorithms.trainers",
    "shardforge.algorithms.trainers.distill",  # its advantage stage (teacher_kl); GRPO's and PPO's come with it
    "shardforge.engine.objectives",
    "shardforge.engine.objectives.distillation",
    "shardforge.rollout.factory",
    "shardforge.rollout.workflows",
    "shardforge.rewards.functions",
    "shardforge.algorithms.loggers",
)


class _TrainHelp(argparse.Action):
    """``train <algo> --help``: the usage plus every config key (type, default, docstring)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show this help and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        text = parser.format_help()
        algorithm = getattr(namespace, "algorithm", None)
        if isinstance(algorithm, str) and algorithm in TRAINERS:
            from shardforge.algorithms.config_io import describe_config

            rows = describe_config(TRAINERS.get(algorithm).config_cls)
            text += f"\nconfig keys of `{algorithm}` (YAML keys, or key=value overrides):\n"
            for key, kind, default, doc in rows:
                text += f"  {key} ({kind}, default {default})\n" + (f"      {doc}\n" if doc else "")
        else:
            text += "\n`shardforge train <algorithm> --help` lists that trainer's config keys.\n"
        sys.stdout.write(text)
        parser.exit(0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardforge", description="Distributed LLM training on HF models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", type=str.upper, choices=_LOG_LEVELS, default="INFO", help="logging level")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks (every rank's) on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a model", description="Train with a YAML config plus overrides.", add_help=False
    )
    train.add_argument("-h", "--help", action=_TrainHelp)
    train.add_argument("algorithm", help=f"a registered trainer: {TRAINERS.names()} (see `shardforge list`)")
    train.add_argument(
        "--log-level", type=str.upper, choices=_LOG_LEVELS, default=argparse.SUPPRESS, help="logging level"
    )
    train.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    train.add_argument("--config", required=True, help="YAML config file")
    train.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine")
    from shardforge.algorithms.launch.multinode import add_launch_arguments

    add_launch_arguments(train)
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything, print the resolved config, layout, predicted memory and data row counts; train nothing",
    )
    train.epilog = "Any further key=value arguments override config entries, e.g. engine.optimizer.lr=1e-3"
    evaluate = sub.add_parser(
        "eval",
        help="evaluate a model on held-out prompts (greedy accuracy, avg@n, pass@k)",
        description="Evaluate with a YAML config (keys: `shardforge eval --config x.yaml --dry-run`) plus overrides.",
    )
    evaluate.add_argument("--config", required=True, help="YAML config file (model, eval_files, eval_sampling, ...)")
    evaluate.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine")
    add_launch_arguments(evaluate)
    evaluate.add_argument("--dry-run", action="store_true", help="check everything and print the resolved config")
    evaluate.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    evaluate.epilog = "Any further key=value arguments override config entries, e.g. eval_sampling.samples=8"
    sub.add_parser("list", help="list every registry (trainers, losses, estimators, ...) with its names")
    reference = sub.add_parser(
        "config-reference", help="write docs/configuration.md: every config key of every trainer"
    )
    reference.add_argument("--out", default="docs/configuration.md", help="the page to write (or check)")
    reference.add_argument("--check", action="store_true", help="only check the page is current; exit 1 if not")
    from shardforge.algorithms.cli.demo_commands import add_demo_parsers
    from shardforge.algorithms.cli.serve import add_serve_parser
    from shardforge.algorithms.cli.serve_openai import add_serve_openai_parser
    from shardforge.algorithms.demos.prepare_tiny import add_prepare_tiny_parser
    from shardforge.algorithms.plan.report import add_plan_parser

    add_demo_parsers(sub)
    add_plan_parser(sub)
    add_serve_openai_parser(sub)
    add_serve_parser(sub)
    add_prepare_tiny_parser(sub)
    return parser


def _config_reference(out: str, *, check: bool) -> int:
    from shardforge.algorithms.cli.config_reference import check_reference, render_reference

    if check:
        problems = check_reference(out)
        for problem in problems:
            log.error(problem)
        return 1 if problems else 0
    Path(out).write_text(render_reference())
    log.info("wrote %s", out)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardforge-algorithms")
    except PackageNotFoundError:
        return "unknown"


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from shardforge.algorithms.config_io import apply_overrides, build_config, load_yaml

    if args.command == "eval":
        from shardforge.algorithms.trainers.eval_run import EVAL as trainer
    elif args.algorithm not in TRAINERS and ":" not in args.algorithm:
        raise ValueError(
            f"unknown algorithm {args.algorithm!r}; available: {TRAINERS.names()} (see `shardforge list`), or a "
            "user's TrainerSpec as 'package.module:NAME'"
        )
    else:
        trainer = TRAINERS.get(args.algorithm)
        if not isinstance(trainer, TrainerSpec):
            raise ValueError(f"{args.algorithm!r} is a {type(trainer).__name__}, not a TrainerSpec(config_cls=, run=)")
    # Models and tokenizers are local directories: never a Hub lookup (set HF_HUB_OFFLINE=0 to allow one).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data = apply_overrides(load_yaml(args.config), args.overrides)
    config = build_config(trainer.config_cls, data)
    config = importlib.import_module("shardforge.algorithms.cli.preflight").resolve_auto(args, config)  # layout: auto
    for path in getattr(config, "eval_files", ()):  # eval: every file is checked before any rank starts
        from shardforge.algorithms.data.jsonl import read_jsonl

        read_jsonl(path, "eval file", trainer.row_fields)
    return _launch_or_run(args, argv, trainer, config)


def _launch_or_run(args: argparse.Namespace, argv: list[str], trainer: TrainerSpec, config: Any) -> int:
    from shardforge.algorithms.trainers.run.lock import run_lock  # one run per output_dir (docs/runs.md)

    output_dir, node_rank = getattr(config, "output_dir", None), 0
    if "WORLD_SIZE" not in os.environ:  # the launching process: check everything before any rank starts
        from shardforge.algorithms.cli.preflight import preflight
        from shardforge.algorithms.launch.multinode import launch_spec

        spec = launch_spec(args)  # --nnodes/--node-rank/--rdzv-endpoint or Slurm's environment
        node_rank = spec.node_rank
        trains_here = not (args.dry_run or spec.launcher == "ray" or spec.needs_agent)
        dims = preflight(config, spec.world_size, trainer.row_fields, keep_rows=trains_here)
        from shardforge.rewards.ray_pool import reward_workers_for_launcher
        from shardforge.rollout.ray.placement import rollout_actor_spec

        rollout_actors = rollout_actor_spec(
            config, spec.launcher, spec.world_size
        )  # rollout.placement=disaggregated: Ray only
        reward_workers = reward_workers_for_launcher(config, spec.launcher)  # reward.ray_workers: Ray only
        if args.dry_run:
            from shardforge.algorithms.cli.dryrun import dry_run_report

            sys.stdout.write(dry_run_report(config, dims, spec.world_size) + "\n")
            return 0
        if not trains_here:
            with run_lock(output_dir, node_rank=node_rank):
                return _launch(args, argv, spec, rollout_actors, reward_workers)
    with run_lock(output_dir, node_rank=node_rank):
        return _run_here(trainer, config)


def _launch(args: argparse.Namespace, argv: list[str], spec: Any, rollout_actors: Any, reward_workers: Any) -> int:
    """Start the ranks (Ray actors, or torchrun's agent in this process) and wait for them."""
    if spec.launcher == "ray":
        from shardforge.algorithms.launch.ray import launch_ray

        end_startup_gc()  # the Ray driver lives as long as the run
        return launch_ray(
            spec,
            argv,
            entry="shardforge.algorithms.cli.main:main",
            address=args.ray_address,
            debug=args.debug,
            rollout=rollout_actors,
            reward_workers=reward_workers,
        )
    from shardforge.algorithms.launch.torchrun import relaunch

    return relaunch(spec, argv, debug=args.debug)


def _run_here(trainer: TrainerSpec, config: Any) -> int:
    """Train as this process's one rank (world 1, or a rank started by a torchrun agent)."""
    from shardforge.algorithms.launch.torchrun import die_with_launcher
    from shardforge.algorithms.trainers.run.threads import set_process_threads

    die_with_launcher()  # a rank never outlives the agent that started it (kill -9 included)
    set_process_threads(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))
    summary = trainer.run(config)
    from shardforge.mesh import destroy_distributed

    destroy_distributed()
    if "stopped_by" in summary:  # SIGTERM / Ctrl-C: checkpoint saved at a step boundary
        return 128 + int(getattr(signal, summary["stopped_by"]))
    log.info("done: %s", summary)
    return 0


def _report(exc: BaseException) -> int:
    """One concise error line; returns the exit code.

    Under our own relaunch every rank hands its line to the launcher (`launch.write_rank_error`),
    which prints the first one: the rank that failed first may not be rank 0, and rank 0 may be
    stopped by the agent before it could print. Under an external torchrun rank 0 prints.
    """
    from shardforge.algorithms.launch.torchrun import write_rank_error

    user_error = isinstance(exc, (ValueError, TypeError, OSError, FloatingPointError))
    message = str(exc) if user_error else f"{type(exc).__name__}: {exc}"
    hint = "" if user_error else " (rerun with --debug for the traceback)"
    line = f"shardforge: error: {message}{hint}\n"
    if not write_rank_error(line) and int(os.environ.get("RANK", "0")) == 0:
        sys.stderr.write(line)
    return 1


def _list() -> int:
    """Print every registry with each name and its one-line description (stdout, on purpose)."""
    from shardforge.core.registry import all_registries

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
    # No cyclic garbage collection while this process starts up (startup_gc.py): on the demo SFT at 2 ranks
    # the collections were about a fifth of each rank's start-up (importing torch already counts here).
    with paused_gc():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if "=" not in a or a.startswith("-")]
    if bad or (extra and args.command not in ("train", "eval")):
        hint = (
            "overrides look like key=value"
            if args.command in ("train", "eval")
            else f"`{args.command}` takes no key=value"
        )
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)} ({hint}; see shardforge {args.command} -h)")
    args.overrides = extra
    setup_logging(args.log_level)
    try:
        return _dispatch(args, argv)
    except Exception as exc:
        if args.debug:
            raise
        return _report(exc)


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "list":
        return _list()
    if args.command == "config-reference":
        return _config_reference(args.out, check=args.check)
    if args.command in ("train", "eval"):
        return _train(args, argv)  # the collector stays paused until the first step (or the agent waits)
    end_startup_gc()
    if args.command == "serve-openai":
        from shardforge.algorithms.cli.serve_openai import serve_openai

        return serve_openai(args)
    if args.command == "serve":
        from shardforge.algorithms.cli.serve import serve

        return serve(args, argv)
    if args.command == "prepare-tiny":
        from shardforge.algorithms.demos.prepare_tiny import prepare_tiny

        prepare_tiny(args.out, sft_steps=args.sft_steps, force=args.force)
        return 0
    if args.command.startswith("demo"):
        from shardforge.algorithms.cli.demo_commands import run_demo_command

        return run_demo_command(args)
    if args.command == "plan":
        from shardforge.algorithms.plan.report import run_plan

        return run_plan(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
