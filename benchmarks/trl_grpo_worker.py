"""TRL side of bench_vs_trl.py's GRPO pair: one `trl.GRPOTrainer` run on the given prompts, in the given order.

Launched by bench_vs_trl.py under ``torchrun --standalone --nproc-per-node N`` (DDP over gloo). The
prompts are in shardforge's per-step order (``shuffle_dataset=False``: step k generates for the same
prompts in both tools), with the same group size, max new tokens, temperature, reward function
(`shardforge.algorithms.testing.digit_reward`), clip range, optimiser and constant learning rate; no KL
(beta 0, both tools' default), token-mean loss (TRL's "dapo" = shardforge's "token-mean"), one update
per batch (TRL's ``num_iterations=1``: no old-log-prob recompute, as shardforge's reuse path),
generation with HF ``generate`` in the training processes (TRL's default without vLLM; shardforge's
embedded engine). Rank 0 writes each optimizer step's end time, rewards and completion lengths.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: start-up is measured from the process start

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def main(args_file: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from shardforge.algorithms.testing import digit_reward

    args: dict[str, Any] = json.loads(Path(args_file).read_text())
    torch.manual_seed(args["seed"])
    rows = [json.loads(line) for line in Path(args["rows"]).read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32, attn_implementation="sdpa")

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [digit_reward(p, c, ref) for p, c, ref in zip(prompts, completions, answer)]

    record: dict[str, Any] = {"process_start": STARTED, "step_end": [], "reward": [], "length": [], "world": world}

    class Timer(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, _args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record["step_end"].append(time.time())

        def on_log(self, _args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "reward" in logs:
                record["reward"].append(float(logs["reward"]))
                record["length"].append(float(logs.get("completions/mean_length", float("nan"))))

    group = args["group_size"]
    config = GRPOConfig(
        output_dir=args["output_dir"],
        per_device_train_batch_size=args["prompts_per_step"] * group // world,
        gradient_accumulation_steps=1,
        num_generations=group,
        max_completion_length=args["max_new_tokens"],
        temperature=args["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        epsilon=args["clip_eps_low"],
        epsilon_high=args["clip_eps_high"],
        num_iterations=1,
        shuffle_dataset=False,
        max_steps=args["steps"],
        learning_rate=args["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=args["weight_decay"],
        max_grad_norm=args["max_grad_norm"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=args["seed"],
        bf16=False,  # TRL defaults to bf16 autocast: ~20x slower on a CPU without native bf16; fp32 as shardforge
        fp16=False,
        disable_tqdm=True,
        ddp_backend="gloo" if world > 1 else None,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[Timer()],
    )  # fmt: skip
    trainer.train()
    if rank == 0:
        record["process_end"] = time.time()
        Path(args["out"]).write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
