"""What the TRL workers (trl_sft_worker.py, trl_grpo_worker.py) share: the run's inputs and a step timer.

Imported by the workers after their start time is taken (start-up counts from the process start).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def load_run(args_file: str) -> dict[str, Any]:
    """The worker's args (JSON), seeded torch, the rows as a `datasets.Dataset`, world/rank, tokenizer and
    the fp32 model with SDPA attention (what both tools run)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args: dict[str, Any] = json.loads(Path(args_file).read_text())
    torch.manual_seed(args["seed"])
    rows = [json.loads(line) for line in Path(args["rows"]).read_text().splitlines()]
    return {
        "args": args,
        "dataset": Dataset.from_list(rows),
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "rank": int(os.environ.get("RANK", "0")),
        "tokenizer": AutoTokenizer.from_pretrained(args["model"]),
        "model": AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32, attn_implementation="sdpa"),
    }


def trainer_args(run: dict[str, Any]) -> dict[str, Any]:
    """The `TrainingArguments` both TRL runs share: shardforge's optimiser and schedule (AdamW, constant lr,
    no warm-up, clipping), one log per step, no saving or trackers, CPU, in-process data loading, fp32."""
    args = run["args"]
    return {
        "output_dir": args["output_dir"],
        "gradient_accumulation_steps": 1,
        "max_steps": args["steps"],
        "learning_rate": args["lr"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": args["weight_decay"],
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": args["max_grad_norm"],
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "seed": args["seed"],
        # TRL defaults to bf16=True: CPU autocast to bf16, ~20x slower per step on a CPU without native bf16
        # (measured on the AMD EPYC CI machine) and not what shardforge runs (fp32). Same precision.
        "bf16": False,
        "fp16": False,
        "disable_tqdm": True,
        "ddp_backend": "gloo" if run["world"] > 1 else None,
    }


def step_timer(record: dict[str, Any], logged: dict[str, str]) -> Any:
    """A `TrainerCallback` appending each optimizer step's end time to ``record["step_end"]`` and, for each
    ``logged`` item ``record key -> log key``, the logged value (when the log line has ``logged``'s first key)."""
    from transformers import TrainerCallback

    first = next(iter(logged.values()))

    class Timer(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, _args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record["step_end"].append(time.time())

        def on_log(self, _args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and first in logs:
                for key, name in logged.items():
                    record.setdefault(key, []).append(float(logs.get(name, float("nan"))))

    return Timer()


def write_record(run: dict[str, Any], record: dict[str, Any]) -> None:
    if run["rank"] == 0:
        record["process_end"] = time.time()
        Path(run["args"]["out"]).write_text(json.dumps(record))
