"""`shardforge prepare-tiny`: everything the ``examples/*_tiny.yaml`` files read, in one command.

Under ``--out`` (default ``outputs``, the folder the examples name):

- ``demo/model`` + ``demo/data/{train,eval}.jsonl``: the SFT demo's character tokenizer, an untrained
  3.2M-parameter Qwen3 and the addition data (``shardforge demo --prepare-only``);
- ``tiny/sft/hf``: that model after a short SFT on the addition data (``--sft-steps``, one process), the
  starting policy of the RL / DPO / RM / eval / distillation examples;
- ``tiny_chat/model`` + ``tiny_chat/data/{train,eval,sft}.jsonl``: a tiny Qwen3 whose tokenizer has Qwen3's
  chat markers and a chat template that renders tools and tool calls, with calculator-task data (the
  tool-use example);
- ``demo_vlm/model`` + ``demo_vlm/data``: the tiny Qwen2.5-VL and its coloured-square images.

Each part is skipped when its directory is complete already (``--force`` rebuilds everything).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from shardforge.core.log import get_logger

__all__ = ["add_prepare_tiny_parser", "prepare_tiny"]

logger = get_logger(__name__)


def add_prepare_tiny_parser(sub: Any) -> Any:
    tiny = sub.add_parser(
        "prepare-tiny", help="build every model and data file examples/*_tiny.yaml read (CPU, ~1 min)"
    )
    tiny.add_argument("--out", default="outputs", help="the folder the examples name (outputs)")
    tiny.add_argument("--sft-steps", type=int, default=150, help="steps of the short SFT the RL examples start from")
    tiny.add_argument("--force", action="store_true", help="rebuild what is there already")
    return tiny


def _done(path: Path) -> bool:
    return (path / ".prepared").is_file()


def _mark(path: Path, info: dict[str, Any]) -> None:
    (path / ".prepared").write_text(json.dumps(info, indent=2, default=str))


def _sft(model: str, train: Path, eval_file: Path, out: Path, steps: int) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers import TRAINERS

    spec = TRAINERS.get("sft")
    config = build_config(
        spec.config_cls,
        {
            "model": model, "train_file": str(train), "eval_file": str(eval_file), "output_dir": str(out),
            "layout": "d1", "steps": steps, "global_batch_size": 32, "progress": True, "resume": "never",
            "loggers": ["jsonl"],
            "engine": {"max_tokens_per_microbatch": 1024, "optimizer": {"lr": 3e-3},
                       "scheduler": {"kind": "cosine", "warmup_steps": min(10, steps // 5)}},
        },
    )  # fmt: skip
    spec.run(config)


def prepare_tiny(out_dir: str | Path = "outputs", *, sft_steps: int = 150, force: bool = False) -> dict[str, str]:
    """Build the tiny models and data of the examples under ``out_dir``; return the main paths."""
    from shardforge.algorithms.demos.demo import prepare_demo
    from shardforge.algorithms.demos.demo_agent import make_tool_data, tool_names_template
    from shardforge.algorithms.demos.demo_vlm import prepare_vlm_demo
    from shardforge.algorithms.testing import tiny_chat_assets

    out = Path(out_dir)
    started = time.time()
    demo, sft, chat, vlm = out / "demo", out / "tiny" / "sft", out / "tiny_chat", out / "demo_vlm"
    if force:
        for path in (demo, sft, chat, vlm):
            shutil.rmtree(path, ignore_errors=True)
    if not _done(demo):
        assets = prepare_demo(demo)
        _mark(demo, assets)
    if not _done(sft):
        shutil.rmtree(sft, ignore_errors=True)
        logger.info("SFT of the demo model for %d steps (the RL, DPO, RM and eval examples start from it)", sft_steps)
        _sft(str(demo / "model"), demo / "data" / "train.jsonl", demo / "data" / "eval.jsonl", sft, sft_steps)
        _mark(sft, {"steps": sft_steps})
    if not _done(chat):
        tiny_chat_assets(chat, hidden=64, layers=2, chat_template=tool_names_template())
        make_tool_data(chat / "data", num_sft=64, num_eval=32, num_rl=256)
        _mark(chat, {})
    if not _done(vlm):
        prepare_vlm_demo(vlm, num_train=64, num_eval=16)
        _mark(vlm, {})
    paths = {
        "demo model": str(demo / "model"), "sft model": str(sft / "hf"), "tool chat model": str(chat / "model"),
        "vlm model": str(vlm / "model"),
    }  # fmt: skip
    logger.info("prepared in %.0f s: %s", time.time() - started, ", ".join(f"{k}: {v}" for k, v in paths.items()))
    return paths
