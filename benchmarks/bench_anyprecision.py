"""AnyPrecisionAdamW vs fp32 AdamW vs plain bf16 AdamW: 200-step loss curves and state bytes per param.

One process, a tiny Qwen3 (hidden 64, 2 layers, vocab 128) memorising one fixed batch
with a small learning rate (3e-5): most AdamW updates are below half a bf16 ulp of the
weights they change, which is exactly where keeping the weights in bf16 hurts.

* fp32 AdamW: fp32 params and moments (``torch.optim.AdamW``), the reference curve.
* AnyPrecisionAdamW: bf16 params (no fp32 master), bf16 moments, bf16 Kahan buffer.
* plain bf16 AdamW: ``torch.optim.AdamW`` on bf16 params (moments bf16 too); nothing
  keeps the update bits that rounding loses.

Reported: the max over steps of |loss - fp32 loss| / fp32 loss for both bf16 variants (the
headline), the final-loss shortfall as a fraction of fp32's progress, and the bytes per
parameter of the optimizer state and of the parameter itself, *measured* from the
optimizer's state tensors after the run.

Run: ``python benchmarks/bench_anyprecision.py`` from the repo root (about a minute).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "anyprecision"
STEPS = 200
LR = 3e-5
TARGET_GAP_RATIO = 0.1  # AnyPrecision's max gap to fp32 must be <= 10 % of plain bf16's
MODEL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
}
STATE_KEYS = ("exp_avg", "exp_avg_sq", "compensation")


def _train(model: Any, optimizer: Any, ids: Any) -> list[float]:
    import torch

    vocab = MODEL["vocab_size"]
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _bytes_per_param(model: Any, optimizer: Any) -> dict[str, float]:
    numel = sum(p.numel() for p in model.parameters())
    state = sum(optimizer.state[p][k].nbytes for p in model.parameters() for k in STATE_KEYS if k in optimizer.state[p])
    param = sum(p.nbytes for p in model.parameters())
    return {"state": state / numel, "param": param / numel, "total": (state + param) / numel}


def run() -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from shardforge.memory import AnyPrecisionAdamW

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(Qwen3Config(**MODEL), attn_implementation="sdpa")
    ids = torch.randint(0, MODEL["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(1))
    variants: dict[str, Any] = {
        "fp32 AdamW": (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=False)),
        "AnyPrecisionAdamW (bf16 params, bf16 moments, Kahan)": (
            torch.bfloat16,
            lambda ps: AnyPrecisionAdamW(ps, lr=LR, use_kahan_summation=True),
        ),
        "plain bf16 AdamW": (torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=False)),
    }
    out: dict[str, Any] = {}
    for name, (dtype, make) in variants.items():
        model = copy.deepcopy(base).to(dtype)
        optimizer = make(model.parameters())
        started = time.perf_counter()
        losses = _train(model, optimizer, ids)
        out[name] = {
            "losses": losses,
            "seconds": time.perf_counter() - started,
            "bytes_per_param": _bytes_per_param(model, optimizer),
        }
        print(f"[{NAME}] {name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {out[name]['bytes_per_param']}", flush=True)
    fp32 = out["fp32 AdamW"]["losses"]
    progress = fp32[0] - fp32[-1]
    for entry in out.values():
        entry["max_rel_gap"] = max(abs(a - b) / b for a, b in zip(entry["losses"], fp32))
        entry["final_shortfall_of_progress"] = (entry["losses"][-1] - fp32[-1]) / progress
    return out


def plot(variants: dict[str, Any], png: Path) -> None:
    plt = _common.pyplot()
    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    fp32 = variants["fp32 AdamW"]["losses"]
    styles = {"fp32 AdamW": "k-", "plain bf16 AdamW": "r--"}
    for name, entry in variants.items():
        style = styles.get(name, "b-")
        # fp32 drawn wide and pale: AnyPrecision's curve lies on top of it.
        width, alpha = (4.0, 0.35) if name == "fp32 AdamW" else (1.5, 1.0)
        label = f"{name} ({entry['bytes_per_param']['total']:.0f} B/param)"
        ax.plot(range(1, STEPS + 1), entry["losses"], style, linewidth=width, alpha=alpha, label=label)
        if name != "fp32 AdamW":
            gaps = [(a - b) / b for a, b in zip(entry["losses"], fp32)]
            gap_ax.plot(range(1, STEPS + 1), gaps, style, label=f"{name}: max |gap| {entry['max_rel_gap']:.1e}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"Tiny Qwen3, lr {LR:g}: loss curves")
    ax.legend(fontsize=7)
    gap_ax.axhline(0, color="black", linewidth=0.5)
    gap_ax.set_xlabel("step")
    gap_ax.set_ylabel("(loss - fp32 loss) / fp32 loss")
    gap_ax.set_title("relative gap to fp32 AdamW")
    gap_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    started = time.perf_counter()
    info = _common.machine_info()
    variants = run()
    anyp = variants["AnyPrecisionAdamW (bf16 params, bf16 moments, Kahan)"]
    plain = variants["plain bf16 AdamW"]
    fp32 = variants["fp32 AdamW"]
    ratio = anyp["max_rel_gap"] / plain["max_rel_gap"]
    met = ratio <= TARGET_GAP_RATIO
    bytes_ratio = anyp["bytes_per_param"]["total"] / fp32["bytes_per_param"]["total"]
    result = {
        "benchmark": NAME,
        "description": "200-step loss curves of fp32 AdamW, AnyPrecisionAdamW (bf16 + Kahan) and plain bf16 AdamW",
        "model": MODEL,
        "steps": STEPS,
        "lr": LR,
        "variants": variants,
        "gap_ratio": ratio,
        "target_gap_ratio": TARGET_GAP_RATIO,
        "met": met,
        "machine": info,
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    json_path = _common.write_json(NAME, result)
    png = _common.png_path(NAME)
    plot(variants, png)
    _common.upsert_result_row(
        benchmark="anyprecision_adamw_tracking",
        metric=(
            f"max relative loss gap to fp32 AdamW over {STEPS} steps (tiny Qwen3, lr {LR:g}, bf16 params, no fp32 "
            "master): AnyPrecisionAdamW bf16 moments + Kahan vs plain bf16 AdamW [final-loss shortfall, "
            "fraction of fp32's progress]"
        ),
        ours=f"{anyp['max_rel_gap']:.1e} [{anyp['final_shortfall_of_progress']:.3f}]",
        baseline=f"{plain['max_rel_gap']:.1e} [{plain['final_shortfall_of_progress']:.3f}] (plain bf16 AdamW)",
        ratio=f"{ratio:.3f}",
        target=_common.target_cell(f"<= {TARGET_GAP_RATIO:.2f}", met),
        machine=_common.machine_label(info),
    )
    _common.upsert_result_row(
        benchmark="anyprecision_adamw_bytes",
        metric="bytes per parameter, optimizer state + parameter (measured from the state tensors)",
        ours=(
            f"{anyp['bytes_per_param']['total']:.1f} ({anyp['bytes_per_param']['state']:.1f} state "
            f"+ {anyp['bytes_per_param']['param']:.1f} param)"
        ),
        baseline=(
            f"{fp32['bytes_per_param']['total']:.1f} ({fp32['bytes_per_param']['state']:.1f} "
            f"+ {fp32['bytes_per_param']['param']:.1f}, fp32 AdamW)"
        ),
        ratio=f"{bytes_ratio:.3f}",
        target=_common.target_cell("<= 0.67", bytes_ratio <= 0.67 + 1e-9),
        machine=_common.machine_label(info),
    )
    print(
        f"[{NAME}] max relative gap to fp32: AnyPrecision {anyp['max_rel_gap']:.2e}, plain bf16 "
        f"{plain['max_rel_gap']:.2e} (ratio {ratio:.3f}); bytes/param {anyp['bytes_per_param']['total']:.1f} vs "
        f"{fp32['bytes_per_param']['total']:.1f}",
        flush=True,
    )
    print(
        f"[{NAME}] wrote {json_path}, {png} and two rows in {_common.RESULTS_MD}; {result['seconds']:.0f} s", flush=True
    )
    return 1 if not met and "--strict" in sys.argv[1:] else 0


if __name__ == "__main__":
    sys.exit(main())
