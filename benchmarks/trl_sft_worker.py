"""TRL side of bench_vs_trl.py: one `trl.SFTTrainer` run on pre-tokenised rows, in the given order.

Launched by bench_vs_trl.py as ``python trl_sft_worker.py ARGS.json`` (one process) or under
``torchrun --standalone --nproc-per-node 2`` (DDP over gloo, as `accelerate` sets it up for CPU
processes). The rows (``input_ids`` + ``completion_mask``, tokenised by shardforge's own SFT
loader) are in shardforge's global-batch order and read sequentially, so step k of both tools
trains on the same sequences from the same weights with the same AdamW, clipping and constant
learning rate. Rank 0 writes the wall-clock time of every optimizer step's end and the logged
losses to ``ARGS["out"]``.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: start-up is measured from the process start

import sys  # noqa: E402
from typing import Any  # noqa: E402

from _trl_worker import load_run, step_timer, trainer_args, write_record  # noqa: E402


def main(args_file: str) -> None:
    from torch.utils.data import SequentialSampler
    from trl import SFTConfig, SFTTrainer

    run = load_run(args_file)
    args, world = run["args"], run["world"]
    record: dict[str, Any] = {"process_start": STARTED, "step_end": [], "loss": [], "world": world}

    class InOrderSFTTrainer(SFTTrainer):  # type: ignore[misc]
        """Reads the rows in the order given (shardforge's batch order) instead of shuffling."""

        def _get_train_sampler(self, *a: Any, **k: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

    config = SFTConfig(
        **trainer_args(run),
        per_device_train_batch_size=args["global_batch_size"] // world,
        completion_only_loss=True,
        padding_free=False,  # HF SDPA ignores packed position_ids in transformers 5: padding is the correct mode
        max_length=None,
    )
    trainer = InOrderSFTTrainer(
        model=run["model"], args=config, train_dataset=run["dataset"], processing_class=run["tokenizer"],
        callbacks=[step_timer(record, {"loss": "loss"})],
    )  # fmt: skip
    trainer.train()
    write_record(run, record)


if __name__ == "__main__":
    main(sys.argv[1])
