"""Checkpoint bandwidth: DCP (sync and async, via our Checkpointer) vs torch.save/torch.load.

Question: does our crash-safe DCP path cost bandwidth compared with the simplest
baseline, and how long does an async save block training?

Setup: one process, a ~70M-parameter Qwen3-shaped model plus AdamW state (~0.8 GB of
tensors). Both paths write the same tensors to the same disk and fsync (DCP's writer
fsyncs for crash safety; the baseline gets an explicit fsync so durability is equal; the
unsynced baseline is reported in the JSON too). Best of ``REPEATS`` runs.

Async saves are measured with a pause between ``save`` and the next ``wait`` standing in
for the training steps between two checkpoints (saves are never back to back in a run).

Targets: sync DCP save >= 0.8x torch.save bandwidth; async blocking <= 25% of a sync save.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import torch

NAME = "checkpoint_bandwidth"
REPEATS = 3


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=16000, hidden_size=768, intermediate_size=2304, num_hidden_layers=6,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # materialise exp_avg / exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    return 0


def _best(fn: Any) -> float:
    times = []
    for _ in range(REPEATS):
        times.append(fn())
    return min(times)


def main() -> None:
    from shardforge.checkpoint_dcp import Checkpointer, TrainState

    model, optimizer = _build()
    state = TrainState(model, optimizer)
    full = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    nbytes = _nbytes(full)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=os.environ.get("BENCH_TMP")))
    results: dict[str, float] = {}
    try:
        target = root / "torch.pt"

        def torch_save(sync: bool = True) -> float:
            start = time.perf_counter()
            with target.open("wb") as handle:
                torch.save(full, handle)
                handle.flush()
                if sync:
                    os.fsync(handle.fileno())
            return time.perf_counter() - start

        def torch_load() -> float:
            start = time.perf_counter()
            torch.load(target, weights_only=True)
            return time.perf_counter() - start

        results["torch_save_fsync_s"] = _best(torch_save)
        results["torch_save_nofsync_s"] = _best(lambda: torch_save(False))
        results["torch_load_s"] = _best(torch_load)

        step = iter(range(1, 1000))
        sync_ckpt = Checkpointer(root / "dcp_sync", keep_last=1)

        def dcp_save() -> float:
            start = time.perf_counter()
            sync_ckpt.save(next(step), {"train": state})
            return time.perf_counter() - start

        def dcp_load() -> float:
            start = time.perf_counter()
            sync_ckpt.load({"train": state})
            return time.perf_counter() - start

        results["dcp_save_s"] = _best(dcp_save)
        results["dcp_load_s"] = _best(dcp_load)

        for mode in ("async", "async_pinned"):
            ckpt = Checkpointer(root / f"dcp_{mode}", keep_last=1, async_mode=mode)  # type: ignore[arg-type]
            blocking, total = [], []
            for _ in range(REPEATS):
                start = time.perf_counter()
                ckpt.save(next(step), {"train": state})
                blocking.append(ckpt.last_save_blocking_s)
                # Training continues while the checkpoint is written; a save is never
                # back-to-back with the previous one in a real run.
                time.sleep(max(3.0, 2 * results["dcp_save_s"]))
                ckpt.wait()
                total.append(time.perf_counter() - start)
            results[f"{mode}_blocking_s"] = min(blocking)
            results[f"{mode}_total_s"] = min(total)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = nbytes / 1e9
    bw = {k.removesuffix("_s") + "_GBps": gb / v for k, v in results.items() if not k.startswith("async")}
    save_ratio = results["torch_save_fsync_s"] / results["dcp_save_s"]
    load_ratio = results["torch_load_s"] / results["dcp_load_s"]
    async_fraction = results["async_blocking_s"] / results["dcp_save_s"]
    payload = {
        "machine": _common.machine_info(),
        "state_bytes": nbytes,
        "seconds": results,
        "bandwidth_GBps": bw,
        "dcp_save_vs_torch_save": save_ratio,
        "dcp_load_vs_torch_load": load_ratio,
        "async_blocking_fraction_of_sync": async_fraction,
        "async_pinned_blocking_fraction_of_sync": results["async_pinned_blocking_s"] / results["dcp_save_s"],
    }
    _common.write_json(NAME, payload)
    plt = _common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = ["torch.save\n(+fsync)", "DCP save", "async\nblocking", "torch.load", "DCP load"]
    values = [
        results["torch_save_fsync_s"], results["dcp_save_s"], results["async_blocking_s"],
        results["torch_load_s"], results["dcp_load_s"],
    ]  # fmt: skip
    ax.bar(labels, values, color=["gray", "tab:blue", "tab:green", "gray", "tab:blue"])
    ax.set_ylabel("seconds (lower is better)")
    ax.set_title(f"checkpoint of {gb:.2f} GB model + AdamW state")
    fig.tight_layout()
    fig.savefig(_common.png_path(NAME), dpi=110)
    machine = _common.machine_label()
    _common.upsert_result_row(
        benchmark="checkpoint_save (DCP sync vs torch.save+fsync)",
        metric="save GB/s",
        ours=f"{bw['dcp_save_GBps']:.2f}",
        baseline=f"{bw['torch_save_fsync_GBps']:.2f}",
        ratio=f"{save_ratio:.2f}",
        target=_common.target_cell(">= 0.80", save_ratio >= 0.8),
        machine=machine,
    )
    _common.upsert_result_row(
        benchmark="checkpoint_load (DCP vs torch.load)",
        metric="load GB/s",
        ours=f"{bw['dcp_load_GBps']:.2f}",
        baseline=f"{bw['torch_load_GBps']:.2f}",
        ratio=f"{load_ratio:.2f}",
        target="higher is better",
        machine=machine,
    )
    _common.upsert_result_row(
        benchmark="checkpoint_async_blocking",
        metric="seconds training is blocked by an async save",
        ours=f"{results['async_blocking_s']:.3f}",
        baseline=f"{results['dcp_save_s']:.3f} (sync save)",
        ratio=f"{async_fraction:.2f}",
        target=_common.target_cell("<= 0.25", async_fraction <= 0.25),
        machine=machine,
    )
    print(f"state {gb:.2f} GB; DCP save {bw['dcp_save_GBps']:.2f} GB/s vs torch.save+fsync "
          f"{bw['torch_save_fsync_GBps']:.2f} GB/s (ratio {save_ratio:.2f}); load ratio {load_ratio:.2f}; "
          f"async blocks {async_fraction:.0%} of a sync save")  # fmt: skip


if __name__ == "__main__":
    main()
