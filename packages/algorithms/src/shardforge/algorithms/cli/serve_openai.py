"""`shardforge serve-openai --model DIR`: the OpenAI-compatible endpoint of `shardforge.rollout.openai` over the
embedded HF engine, for evaluation harnesses and agent frameworks written against the OpenAI client."""

from __future__ import annotations

import argparse
import time
from typing import Any

from shardforge.core.log import get_logger

__all__ = ["add_serve_openai_parser", "serve_openai"]

log = get_logger(__name__)


def add_serve_openai_parser(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serve-openai", help="serve a local HF model over an OpenAI-compatible API (/v1/chat/completions, ...)"
    )
    parser.add_argument("--model", required=True, help="an HF model directory (save_pretrained) with its tokenizer")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port")
    parser.add_argument("--name", default=None, help="the model's name in the API (default: the directory name)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="the largest max_tokens a request may ask")
    parser.add_argument("--dtype", default="float32", help="weights dtype of the engine (bfloat16 on GPUs)")
    return parser


def serve_openai(args: argparse.Namespace) -> int:
    from pathlib import Path

    from transformers import AutoTokenizer

    from shardforge.rollout.config import RolloutConfig
    from shardforge.rollout.factory import build_rollout_engine
    from shardforge.rollout.openai import OpenAIEndpoint

    if not Path(args.model).is_dir():
        raise FileNotFoundError(f"--model {args.model!r} is not a directory (an HF model saved with save_pretrained)")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = build_rollout_engine(RolloutConfig(engine="hf", dtype=args.dtype), args.model, tokenizer)
    name = args.name or Path(args.model).resolve().name
    server = OpenAIEndpoint(engine, tokenizer, model_name=name, max_tokens=args.max_tokens)
    server.start(args.host, args.port)
    log.info("serving %s at %s (OPENAI_BASE_URL; the API key names the episode); Ctrl-C stops", name, server.url)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
    return 0
