"""Per-rank model-state memory under FSDP (world 2 and 4) vs the ideal unsharded / N.

Model state = parameters + gradients + AdamW ``exp_avg`` / ``exp_avg_sq``. Everything is
measured, nothing is derived from shapes: a `TrainEngine` runs one real ``train_batch``
and an optimizer step post-hook snapshots the state at the moment all three exist (after
``optimizer.step()``, before the engine's ``zero_grad(set_to_none=True)``).

Two byte counts per rank:

* logical: ``DTensor.to_local().nbytes`` summed over params, grads and optimizer state (the
  headline metric);
* allocated: bytes of the distinct storages behind those tensors, which includes FSDP2's
  padding of uneven shards (a view of a padded buffer is charged the whole buffer).

The ideal is the same measurement on an unsharded world-1 engine, divided by N. The model
has deliberately uneven dim-0 sizes (vocab 1001, MLP width 683) so shards are uneven.

Run: ``python benchmarks/bench_fsdp_memory.py`` from the repo root (about a minute); with
``--strict`` it exits 1 when a target is missed (by default it only reports).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "fsdp_memory"
TARGET = 1.10
WORLDS = (2, 4)
MODEL = {
    "vocab_size": 1001,
    "hidden_size": 256,
    "intermediate_size": 683,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
OPT_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _sequences(num: int = 8, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(MODEL["vocab_size"]) for _ in range(rng.randint(8, 64))] for _ in range(num)]


def _account(model: Any, optimizer: Any) -> dict[str, Any]:
    """Local bytes of params, grads and AdamW moments; plus the distinct storages behind them."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    logical = {"params": 0, "grads": 0, "optim": 0}
    storages: dict[str, dict[int, int]] = {"params": {}, "grads": {}, "optim": {}}
    step_bytes = 0
    missing_grads = 0

    def add(kind: str, tensor: Any) -> None:
        t = local(tensor)
        logical[kind] += t.numel() * t.element_size()
        storage = t.untyped_storage()
        storages[kind][storage.data_ptr()] = storage.nbytes()

    for param in model.parameters():
        add("params", param)
        if param.grad is None:
            missing_grads += 1
        else:
            add("grads", param.grad)
        state = optimizer.state.get(param, {})
        for key in OPT_STATE_KEYS:
            add("optim", state[key])
        if "step" in state:
            step_bytes += local(state["step"]).nbytes
    allocated = {kind: sum(v.values()) for kind, v in storages.items()}
    return {
        "logical": logical,
        "logical_total": sum(logical.values()),
        "allocated": allocated,
        "allocated_total": sum(allocated.values()),
        "adamw_step_scalar_bytes": step_bytes,
        "params_without_grad": missing_grads,
    }


def measure_rank() -> dict[str, Any]:
    """Build the engine on this rank's layout, run one train step, return the hook's snapshot."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config

    from shardforge.engine import EngineConfig, TrainEngine, pack_sequences

    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine = TrainEngine(Qwen3Config(**MODEL), f"d{world}", EngineConfig())
    snapshot: dict[str, Any] = {}

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        snapshot.update(_account(engine.model, optimizer))

    handle = engine.optimizer.register_step_post_hook(hook)
    sequences = _sequences()
    stats = engine.train_batch(pack_sequences(sequences[engine.dp_rank :: engine.dp_size]))
    handle.remove()
    if not snapshot:
        raise RuntimeError(f"the optimizer step was skipped (grad_norm={stats['grad_norm']}); nothing measured")
    snapshot["rank"] = dist.get_rank() if dist.is_initialized() else 0
    snapshot["world"] = world
    snapshot["num_params"] = sum(p.numel() for p in engine.model.parameters())  # global numel (DTensor)
    return snapshot


def plot(result: dict[str, Any], png: Path) -> None:
    plt = _common.pyplot()
    worlds = result["worlds"]
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 4), squeeze=False)
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868"}
    for ax, (world, entry) in zip(axes[0], worlds.items()):
        ranks = entry["per_rank"]
        xs = list(range(len(ranks)))
        bottom = [0.0] * len(ranks)
        for kind, color in colors.items():
            values = [r["logical"][kind] / 2**20 for r in ranks]
            label = {"optim": "AdamW exp_avg + exp_avg_sq"}.get(kind, kind)
            ax.bar(xs, values, bottom=bottom, color=color, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ideal = entry["ideal_bytes"] / 2**20
        ax.axhline(ideal, color="black", linestyle="--", label=f"ideal = unsharded / {world}")
        ax.axhline(ideal * TARGET, color="red", linestyle=":", label=f"target {TARGET:.2f} x ideal")
        ax.set_xticks(xs, [f"rank {r['rank']}" for r in ranks])
        ax.set_ylabel("MiB per rank")
        ax.set_title(f"FSDP world {world}: max/ideal = {entry['ratio_logical']:.3f}")
        ax.set_ylim(0, ideal * TARGET * 1.6)
        ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.suptitle("Model-state memory per rank (params + grads + AdamW state), Qwen3 hidden 256, 4 layers")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    from shardforge.mesh.testing.pool import get_rank_pool

    started = time.perf_counter()
    info = _common.machine_info()
    unsharded = measure_rank()  # world 1 in this process: plain tensors, no process group
    print(
        f"[{NAME}] unsharded: {unsharded['num_params'] / 1e6:.2f}M params, "
        f"{unsharded['logical_total'] / 2**20:.2f} MiB of params + grads + AdamW state",
        flush=True,
    )
    worlds: dict[str, Any] = {}
    for world in WORLDS:
        per_rank = get_rank_pool(world).run(measure_rank, timeout_s=600)
        get_rank_pool(world).close()
        ideal = unsharded["logical_total"] / world
        max_logical = max(r["logical_total"] for r in per_rank)
        max_allocated = max(r["allocated_total"] for r in per_rank)
        entry = {
            "per_rank": per_rank,
            "ideal_bytes": ideal,
            "max_logical_bytes": max_logical,
            "max_allocated_bytes": max_allocated,
            "ratio_logical": max_logical / ideal,
            "ratio_allocated": max_allocated / (unsharded["allocated_total"] / world),
            "sum_logical_over_ranks_bytes": sum(r["logical_total"] for r in per_rank),
            "per_kind_ratio": {
                kind: max(r["logical"][kind] for r in per_rank) / (unsharded["logical"][kind] / world)
                for kind in ("params", "grads", "optim")
            },
            "met": max_logical / ideal <= TARGET,
        }
        worlds[str(world)] = entry
        print(
            f"[{NAME}] world {world}: max per-rank {max_logical / 2**20:.3f} MiB vs ideal {ideal / 2**20:.3f} MiB "
            f"-> ratio {entry['ratio_logical']:.4f} (allocated incl. padding: {entry['ratio_allocated']:.4f}); "
            f"per kind {', '.join(f'{k} {v:.4f}' for k, v in entry['per_kind_ratio'].items())}",
            flush=True,
        )
    result = {
        "benchmark": NAME,
        "description": "max over ranks of local bytes (params + grads + AdamW exp_avg/exp_avg_sq) / (unsharded / N)",
        "target_max_ratio": TARGET,
        "model": MODEL,
        "unsharded": unsharded,
        "worlds": worlds,
        "machine": info,
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    json_path = _common.write_json(NAME, result)
    png = _common.png_path(NAME)
    plot(result, png)
    for world, entry in worlds.items():
        _common.upsert_result_row(
            benchmark=f"{NAME} (FSDP world {world})",
            metric="max per-rank MiB of params + grads + AdamW state",
            ours=f"{entry['max_logical_bytes'] / 2**20:.3f}",
            baseline=f"{entry['ideal_bytes'] / 2**20:.3f} (unsharded / {world})",
            ratio=f"{entry['ratio_logical']:.3f}",
            target=_common.target_cell(f"<= {TARGET:.2f}", entry["met"]),
            machine=_common.machine_label(info),
        )
    print(f"[{NAME}] wrote {json_path}, {png} and a row per world in {_common.RESULTS_MD}", flush=True)
    print(f"[{NAME}] done in {result['seconds']:.0f} s", flush=True)
    missed = [w for w, e in worlds.items() if not e["met"]]
    if missed:
        print(f"[{NAME}] TARGET MISSED for world(s) {', '.join(missed)} (ratio > {TARGET:.2f})", flush=True)
    return 1 if missed and "--strict" in sys.argv[1:] else 0


if __name__ == "__main__":
    sys.exit(main())
