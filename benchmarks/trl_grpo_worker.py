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

import sys  # noqa: E402
from typing import Any  # noqa: E402

from _trl_worker import load_run, step_timer, trainer_args, write_record  # noqa: E402


def main(args_file: str) -> None:
    from trl import GRPOConfig, GRPOTrainer

    from shardforge.algorithms.testing import digit_reward

    run = load_run(args_file)
    args, world = run["args"], run["world"]

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [digit_reward(p, c, ref) for p, c, ref in zip(prompts, completions, answer)]

    record: dict[str, Any] = {"process_start": STARTED, "step_end": [], "reward": [], "length": [], "world": world}

    group = args["group_size"]
    config = GRPOConfig(
        **trainer_args(run),
        per_device_train_batch_size=args["prompts_per_step"] * group // world,
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
    )
    trainer = GRPOTrainer(
        model=run["model"], reward_funcs=reward, args=config, train_dataset=run["dataset"],
        processing_class=run["tokenizer"],
        callbacks=[step_timer(record, {"reward": "reward", "length": "completions/mean_length"})],
    )  # fmt: skip
    trainer.train()
    write_record(run, record)


if __name__ == "__main__":
    main(sys.argv[1])
