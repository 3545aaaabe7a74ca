"""`shardforge serve --model DIR`: the self-hosted Tinker-compatible training service that the official
``tinker`` SDK drives (``ServiceClient(base_url=..., api_key=...)``); docs/tinker.md."""

from __future__ import annotations

import argparse
from typing import Any

from shardforge.core.log import get_logger

__all__ = ["add_serve_parser", "serve"]

log = get_logger(__name__)


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serve", help="serve a local HF model over the Tinker API (LoRA training + sampling for the tinker SDK)"
    )
    parser.add_argument("--model", required=True, help="an HF model directory (save_pretrained) with its tokenizer")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port")
    parser.add_argument("--name", default=None, help="the base_model name clients pass (default: the directory name)")
    parser.add_argument(
        "--api-key", action="append", default=[], metavar="TENANT=tml-...",
        help="a tenant and its API key (repeatable); none given: one key for tenant 'default' is generated and logged",
    )  # fmt: skip
    parser.add_argument("--api-keys", default=None, metavar="FILE", help='a JSON file {"tenant": "tml-...", ...}')
    parser.add_argument(
        "--output-dir",
        default="runs/serve",
        help="where save_state writes checkpoints (DCP, loadable on any --nproc-per-node)",
    )
    parser.add_argument("--max-tokens", type=int, default=1024, help="the largest max_tokens a sample request may ask")
    parser.add_argument(
        "--workers", type=int, default=2, help="worker threads: different training clients' requests run at once"
    )
    parser.add_argument(
        "--logger", action="append", default=[], metavar="NAME",
        help="log each training client's step metrics with this logger (jsonl, tensorboard, wandb, mlflow; repeat "
        "for several) under --output-dir/<tenant>/<model_id>/",
    )  # fmt: skip
    parser.add_argument(
        "--no-batch-tenants", dest="batch_tenants", action="store_false",
        help="run each LoRA tenant's forward_backward alone instead of batching queued ones over the shared base",
    )  # fmt: skip
    parser.add_argument(
        "--batch-window-ms", type=float, default=20.0,
        help="how long a batch of LoRA tenants' forward_backward waits for the other stepping tenants (0: no wait)",
    )  # fmt: skip
    parser.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha of every adapter")
    parser.add_argument(
        "--nproc-per-node", type=int, default=1,
        help="ranks on this machine: the base model is sharded over them with FSDP and/or TP (rank 0 serves HTTP); "
        "LoRA adapters are replicated; a full fine-tuning client's copy is sharded with FSDP (not with TP); "
        "N > 1 relaunches the command through torchrun, like `shardforge train`",
    )  # fmt: skip
    parser.add_argument(
        "--layout", default=None, metavar="LAYOUT",
        help="how the ranks hold the base, in the trainers' layout letters: d (FSDP), r (HSDP replicas) and t "
        "(tensor parallel, with sequence parallelism) only, e.g. d2, r2d2, t2 or d2t2 (default: d<N>, every rank a "
        "shard); LoRA adapters are replicated on every rank",
    )  # fmt: skip
    return parser


def serve(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the service: in this process (one rank), as one rank started by torchrun, or (``--nproc-per-node`` N >
    1 outside torchrun) relaunched on N ranks through torchrun's agent in this process (`launch.torchrun`)."""
    import importlib.util
    import os
    from pathlib import Path

    if not Path(args.model).is_dir():
        raise FileNotFoundError(f"--model {args.model!r} is not a directory (an HF model saved with save_pretrained)")
    if importlib.util.find_spec("tinker") is None:  # the SDK's protobuf messages are the service's wire format
        raise ModuleNotFoundError("shardforge serve needs the tinker SDK: pip install 'shardforge-algorithms[serve]'")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "WORLD_SIZE" not in os.environ and args.nproc_per_node != 1:
        return _launch_ranks(args, argv)
    if args.layout is not None and world == 1:
        log.warning("--layout %s is ignored with one rank (nothing to shard); pass --nproc-per-node N", args.layout)
    if world > 1:
        from shardforge.algorithms.launch.torchrun import die_with_launcher
        from shardforge.algorithms.trainers.run.threads import set_process_threads

        die_with_launcher()  # a rank never outlives the agent that started it
        set_process_threads(int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
        if int(os.environ.get("RANK", "0")) != 0:
            from shardforge.algorithms.serve.ranks import RankRuntime, follow

            follow(RankRuntime(args.model, args.layout or "d-1"))
            return 0
    return _serve_rank0(args, world)


def _launch_ranks(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The launching process: check the layout, then start the ranks and wait for them."""
    from shardforge.algorithms.launch.multinode import LaunchSpec
    from shardforge.algorithms.launch.torchrun import relaunch
    from shardforge.algorithms.serve.ranks import check_serve_layout

    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={args.nproc_per_node} must be >= 1")
    if argv is None:
        raise ValueError("serve with --nproc-per-node > 1 needs the command line to relaunch (run it as `shardforge`)")
    dims = check_serve_layout(args.layout or "d-1", args.nproc_per_node)
    if dims.tp > 1:  # the model's heads, vocabulary and MLP must split over tp: said before any rank starts
        from shardforge.algorithms.serve.tp_lora import check_tp_base
        from shardforge.engine import EngineConfig
        from shardforge.engine.loading import load_hf_config

        check_tp_base(load_hf_config(args.model), dims.tp, sequence_parallel=EngineConfig().sequence_parallel)
    log.info("starting %d ranks (layout %s): rank 0 serves http://%s:%d", args.nproc_per_node, dims, args.host,
             args.port)  # fmt: skip
    return relaunch(LaunchSpec(nproc_per_node=args.nproc_per_node), argv, debug=args.debug)


def _serve_rank0(args: argparse.Namespace, world: int) -> int:
    from shardforge.algorithms.serve.config import ServeConfig
    from shardforge.algorithms.serve.server import ServiceServer
    from shardforge.algorithms.serve.service import TinkerService
    from shardforge.algorithms.serve.tenants import TenantKeys, generate_key

    specs = list(args.api_key)
    if not specs and args.api_keys is None:
        specs = [f"default={generate_key()}"]
        log.warning("no --api-key given; tenant 'default' has the key %s", specs[0].split("=", 1)[1])
    keys = TenantKeys.parse(specs, args.api_keys)
    config = ServeConfig(
        model_dir=args.model, base_model=args.name, output_dir=args.output_dir, max_tokens=args.max_tokens,
        lora_alpha=args.lora_alpha, workers=args.workers, batch_window_s=args.batch_window_ms / 1000,
        batch_tenants=args.batch_tenants, loggers=tuple(args.logger),
        batch_spread=False if world > 1 else None,  # the ranks run one job at a time: one batch, not one per worker
    )  # fmt: skip
    ops = None
    if world > 1:
        from shardforge.algorithms.launch.torchrun import write_rank_error
        from shardforge.algorithms.serve.distributed import sharded_ops

        ops = sharded_ops(args.model, args.layout or "d-1", report=write_rank_error)
    server = ServiceServer(TinkerService(config, keys, ops), host=args.host, port=args.port)
    log.info(
        "serving %s for tenants %s at http://%s:%d (tinker.ServiceClient(base_url=...)); Ctrl-C stops",
        server.service.registry.base_model, keys.tenants, args.host, args.port,
    )  # fmt: skip
    server.serve_forever()
    return 0
