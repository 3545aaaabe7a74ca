"""Tensor parallelism + sequence parallelism (TP 2 and 4): per-rank parameter memory and per-layer communication.

The model is a Qwen3 config with hidden size 1024 (16 query / 8 key-value heads of 64, MLP
width 2816, vocabulary 32000, 2 layers, untied embeddings, fp32, HF ``sdpa`` attention),
built on every rank from the same seed and sharded with `apply_tensor_parallel` (the
built-in Qwen3 plan, ``sequence_parallel=True``). The batch is one sequence of S = 256
tokens (S divisible by tp), with explicit ``position_ids``.

1. Parameter memory. Per rank: local shard bytes (``p.to_local().numel() * element_size``
   for DTensors, full bytes for plain tensors), summed over ``model.parameters()``. The
   ideal is the bytes of the same model built unsharded in the main process, divided by
   tp; the headline is max over ranks / ideal (target <= 1.10). Parameters that stay
   replicated (the RMSNorm weights) are listed with their cost.

2. Communication per decoder layer. Every collective is recorded by a
   `torch.distributed.tensor.debug.CommDebugMode` subclass, with the bytes of its tensor
   argument and its group size. One layer is isolated by running the same measurement on a
   2-layer and a 1-layer model (same seed, same batch) and subtracting: everything outside
   the decoder layers (embedding, final norm, lm_head, loss) cancels. As a cross-check the
   collectives that CommDebugMode's module tracker attributes to ``model.layers.0`` and
   ``model.layers.1`` of the 2-layer run must give the same per-layer numbers.

   Byte convention (applied identically to measured collectives and to the theory): bytes
   each rank sends with a ring algorithm on a group of tp ranks. For a collective whose
   full tensor has B bytes:

   * all-gather (B = the gathered output): each rank sends B * (tp - 1) / tp;
   * reduce-scatter (B = the unreduced input): each rank sends B * (tp - 1) / tp;
   * all-reduce (B = the tensor): each rank sends 2 * B * (tp - 1) / tp
     (a reduce-scatter followed by an all-gather).

   Theory (Megatron-LM sequence parallelism, Korthikanti et al. 2022). With
   A = S * hidden * element_size the bytes of the full [S, hidden] activation:

   * forward, per layer: 2 all-gathers (attention and MLP inputs, sequence shards -> full)
     + 2 reduce-scatters (o_proj and down_proj outputs, partial sums -> sequence shards)
     = 4 * A * (tp - 1) / tp bytes sent per rank;
   * forward + backward, per layer: twice that, 8 * A * (tp - 1) / tp. The backward of an
     all-gather is a reduce-scatter and vice versa; the gathered inputs are saved by
     autograd, so (unlike Megatron's memory-saving option) nothing is re-gathered.

   With S = 256, hidden 1024, fp32: A = 1 MiB, so the theory is 2 MiB forward and 4 MiB
   forward + backward at tp 2, 3 MiB and 6 MiB at tp 4. The target is measured / theory
   within 1.00 +- 0.05, forward and forward + backward. The JSON also gives the "payload"
   convention (sum of full tensor sizes B, whatever the algorithm) and every collective.

   The replicated norm weights' gradients come out of backward as ``Partial(sum)`` DTensors:
   their all-reduce is deferred to whoever reads them (clipping, the optimizer step). The
   script triggers it explicitly after backward (``redistribute`` to the parameter's
   placements), measures it, and reports it separately; the Megatron theory leaves it out.

3. Diagnostic plan variant. The same plan with ``PrepareModuleInput(use_local_output=False)``
   on the attention and MLP inputs (the gathered input stays a replicated DTensor inside
   the block, as in torchtitan) is measured the same way, to show where the built-in
   plan's backward traffic comes from. It is passed with ``apply_tensor_parallel(...,
   plan=...)``; no package code is changed.

Sanity check: the full TP logits of each plan are compared with the unsharded model's.

Run: ``python benchmarks/bench_tp.py`` from the repo root (about a minute and a half on 2 cores);
with ``--strict`` it exits 1 when a target is missed (by default it only reports).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME = "tp"
MEMORY_TARGET = 1.10
COMM_TARGET = 1.00
COMM_TOLERANCE = 0.05
TPS = (2, 4)
SEQ_LEN = 256
SEED = 0
MODEL = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
PLANS = {
    "builtin": "shardforge's built-in Qwen3 plan (sequence_parallel=True)",
    "prepare_input_dtensor": "diagnostic: same plan, PrepareModuleInput(use_local_output=False) on self_attn and mlp",
}
PHASES = ("forward", "backward", "grad_sync")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


# ------------------------------------------------------------------------- on every rank
def _build(num_layers: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(SEED)
    config = Qwen3Config(**{**MODEL, "num_hidden_layers": num_layers})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _batch() -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, MODEL["vocab_size"], (1, SEQ_LEN), generator=generator)
    return input_ids, torch.arange(SEQ_LEN)[None]


def _plan(name: str) -> Any:
    """None (the built-in plan) or the diagnostic variant."""
    if name == "builtin":
        return None
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from shardforge.tensor_parallel import dense_decoder_plan

    plan = dense_decoder_plan(sequence_parallel=True, qk_norm=True)
    for style in plan.values():
        if isinstance(style, PrepareModuleInput):
            style.use_local_output = False
    return plan


def _classify(op: str, in_bytes: int, group_size: int) -> tuple[str, int | None, float | None]:
    """(kind, payload bytes B, bytes this rank sends under the ring convention) of one collective."""
    n = group_size
    if "all_gather_into_tensor" in op and "coalesced" not in op:
        return "all_gather", in_bytes * n, in_bytes * (n - 1)
    if "reduce_scatter_tensor" in op and "coalesced" not in op:
        return "reduce_scatter", in_bytes, in_bytes * (n - 1) / n
    if "all_reduce" in op and "coalesced" not in op:
        return "all_reduce", in_bytes, 2 * in_bytes * (n - 1) / n
    return "unsupported", None, None


def _recorder() -> Any:
    """A CommDebugMode that also records each collective's tensor bytes, group size, phase and module."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    class Recorder(CommDebugMode):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.records: list[dict[str, Any]] = []
            self.phase = "forward"
            self.scope: str | None = None  # overrides the module tracker (grad-sync phase)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
                return out
            packet = func._overloadpacket
            if packet not in self.comm_registry and packet not in c10d_collective_ops:
                return out
            op = str(packet)
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            in_bytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
            if "all_gather_into_tensor" in op or "reduce_scatter_tensor" in op:
                group_size = int(args[1] if "all_gather" in op else args[2])
            elif "_c10d_functional.all_reduce" in op or op.startswith("c10d_functional.all_reduce"):
                group_size = dist.distributed_c10d._resolve_process_group(args[2]).size()
            else:
                group_size = 0
            kind, payload, sent = _classify(op, in_bytes, group_size)
            module = self.scope if self.scope is not None else self.advanced_module_tracker.name
            match = _LAYER_RE.search(module)
            self.records.append(
                {
                    "op": op,
                    "kind": kind,
                    "shape": list(tensor.shape) if tensor is not None else None,
                    "dtype": str(tensor.dtype) if tensor is not None else None,
                    "arg_bytes": in_bytes,
                    "group_size": group_size,
                    "payload_bytes": payload,
                    "sent_bytes": sent,
                    "phase": self.phase,
                    "tracker_is_bw": bool(self.advanced_module_tracker.is_bw),
                    "module": module,
                    "layer": int(match.group(1)) if match else None,
                }
            )
            return out

    return Recorder()


def _param_memory(model: Any) -> dict[str, Any]:
    """Local bytes per parameter, split into sharded and replicated."""
    from torch.distributed.tensor import DTensor, Shard

    total = sharded = replicated = global_bytes = 0
    replicated_params: dict[str, int] = {}
    for name, param in model.named_parameters():
        is_dtensor = isinstance(param, DTensor)
        local = param.to_local() if is_dtensor else param
        nbytes = local.numel() * local.element_size()
        total += nbytes
        global_bytes += param.numel() * param.element_size()  # DTensor.numel() is the global numel
        if is_dtensor and any(isinstance(p, Shard) for p in param.placements):
            sharded += nbytes
        else:
            replicated += nbytes
            replicated_params[name] = nbytes
    return {
        "local_bytes": total,
        "sharded_local_bytes": sharded,
        "replicated_bytes": replicated,
        "replicated_params": replicated_params,
        "global_bytes": global_bytes,
    }


def _trace(model: Any) -> tuple[list[dict[str, Any]], Any]:
    """Record every collective of one forward, backward and grad sync; return (records, loss)."""
    from torch.distributed.tensor import DTensor, Partial

    input_ids, position_ids = _batch()
    recorder = _recorder()
    with recorder:
        recorder.phase = "forward"
        logits = model(input_ids=input_ids, position_ids=position_ids).logits
        # A stand-in loss on this rank's vocab slice: it lies outside the decoder layers, so it
        # cancels in the per-layer numbers, and it needs no collective of its own.
        loss = logits.to_local().float().pow(2).mean()
        recorder.phase = "backward"
        loss.backward()
        recorder.phase = "grad_sync"
        for name, param in model.named_parameters():
            grad = param.grad
            if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
                recorder.scope = name
                grad.redistribute(grad.device_mesh, param.placements)  # what clipping / AdamW would do
        recorder.scope = None
    return recorder.records, logits


def measure_rank(plan_name: str) -> dict[str, Any]:
    """On one TP rank: parameter memory of the 2-layer model, and collectives of a 2- and a 1-layer run."""
    import warnings

    import torch
    import torch.distributed as dist

    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.tensor_parallel import apply_tensor_parallel

    # CommDebugMode's module tracker warns about HF's dataclass outputs; harmless here.
    warnings.filterwarnings("ignore", message=".*backward hook.*", category=UserWarning)
    torch.set_num_threads(1)
    tp = dist.get_world_size()
    tp_mesh = build_mesh(ParallelDims(dp_shard=1, tp=tp)).get("tp")
    result: dict[str, Any] = {"rank": dist.get_rank(), "tp": tp, "plan": plan_name, "records": {}}
    for num_layers in (2, 1):
        model = _build(num_layers)
        apply_tensor_parallel(model, tp_mesh, plan=_plan(plan_name))
        if num_layers == 2:
            result["memory"] = _param_memory(model)
        started = time.perf_counter()
        records, logits = _trace(model)
        result[f"trace_seconds_{num_layers}_layers"] = time.perf_counter() - started
        result["records"][str(num_layers)] = records
        if num_layers == 2:
            full = logits.full_tensor().detach()  # a collective: every rank takes part
            result["logits"] = full if dist.get_rank() == 0 else None
        del model, logits
    return result


# ------------------------------------------------------------------------- in the main process
def theory(tp: int, hidden: int, element_size: int) -> dict[str, float]:
    """Megatron-SP bytes per decoder layer (see the module docstring)."""
    activation = SEQ_LEN * hidden * element_size
    ring = activation * (tp - 1) / tp
    return {
        "activation_bytes": activation,
        "forward_sent_bytes": 2 * ring + 2 * ring,
        "forward_backward_sent_bytes": 2 * (2 * ring + 2 * ring),
        "forward_payload_bytes": 4 * activation,
        "forward_backward_payload_bytes": 8 * activation,
        "forward_collectives": {"all_gather": 2, "reduce_scatter": 2},
        "backward_collectives": {"all_gather": 2, "reduce_scatter": 2},
    }


def _totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase: counts per kind, payload and sent bytes."""
    out: dict[str, Any] = {}
    for phase in PHASES:
        rows = [r for r in records if r["phase"] == phase]
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["kind"]] = counts.get(r["kind"], 0) + 1
        out[phase] = {
            "counts": counts,
            "payload_bytes": sum(r["payload_bytes"] or 0 for r in rows),
            "sent_bytes": sum(r["sent_bytes"] or 0 for r in rows),
        }
    return out


def _minus(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in PHASES:
        kinds = set(a[phase]["counts"]) | set(b[phase]["counts"])
        out[phase] = {
            "counts": {
                k: a[phase]["counts"].get(k, 0) - b[phase]["counts"].get(k, 0)
                for k in sorted(kinds)
                if a[phase]["counts"].get(k, 0) != b[phase]["counts"].get(k, 0)
            },
            "payload_bytes": a[phase]["payload_bytes"] - b[phase]["payload_bytes"],
            "sent_bytes": a[phase]["sent_bytes"] - b[phase]["sent_bytes"],
        }
    return out


def _per_layer(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-layer numbers from the 2-minus-1-layer difference, max over ranks; plus the attribution cross-check."""
    for r in per_rank:
        bad = [x for runs in r["records"].values() for x in runs if x["kind"] == "unsupported"]
        if bad:
            raise RuntimeError(
                f"rank {r['rank']}: collectives this script cannot size: {sorted({x['op'] for x in bad})}"
            )
    diffs = [_minus(_totals(r["records"]["2"]), _totals(r["records"]["1"])) for r in per_rank]
    # The per-layer collectives are the same on every rank; take the max anyway.
    worst = max(diffs, key=lambda d: d["forward"]["sent_bytes"] + d["backward"]["sent_bytes"])
    attributed = {
        f"layer_{layer}": _totals([x for x in per_rank[0]["records"]["2"] if x["layer"] == layer]) for layer in (0, 1)
    }
    agree = all(
        attributed[f"layer_{layer}"][phase]["sent_bytes"] == worst[phase]["sent_bytes"]
        for layer in (0, 1)
        for phase in PHASES
    )
    rank_identical = all(d == diffs[0] for d in diffs)
    fwd = worst["forward"]["sent_bytes"]
    fwd_bwd = fwd + worst["backward"]["sent_bytes"]
    return {
        "by_phase": worst,
        "forward_sent_bytes": fwd,
        "forward_backward_sent_bytes": fwd_bwd,
        "forward_payload_bytes": worst["forward"]["payload_bytes"],
        "forward_backward_payload_bytes": worst["forward"]["payload_bytes"] + worst["backward"]["payload_bytes"],
        "deferred_norm_grad_sync_sent_bytes": worst["grad_sync"]["sent_bytes"],
        "attributed_by_module_tracker": attributed,
        "attribution_agrees_with_difference": agree,
        "identical_on_all_ranks": rank_identical,
    }


def _layer_records(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's collectives inside model.layers.0 (2-layer run), for the JSON."""
    keep = ("phase", "op", "kind", "shape", "dtype", "payload_bytes", "sent_bytes", "module")
    return [{k: x[k] for k in keep} for x in per_rank[0]["records"]["2"] if x["layer"] == 0]


def _in_tolerance(ratio: float) -> bool:
    return abs(ratio - COMM_TARGET) <= COMM_TOLERANCE


def plot(result: dict[str, Any], png: Path) -> None:
    plt = _common.pyplot()
    tps = list(result["tp"])
    fig, (ax_mem, ax_comm) = plt.subplots(1, 2, figsize=(12, 4.5))

    mem = [result["tp"][t]["memory"]["ratio"] for t in tps]
    bars = ax_mem.bar([f"TP {t}" for t in tps], mem, color="#4c72b0", width=0.5)
    ax_mem.bar_label(bars, [f"{v:.4f}" for v in mem])
    ax_mem.axhline(1.0, color="black", linestyle="--", label="ideal (unsharded / tp)")
    ax_mem.axhline(MEMORY_TARGET, color="red", linestyle=":", label=f"target <= {MEMORY_TARGET:.2f}")
    ax_mem.set_ylim(0, MEMORY_TARGET * 1.4)
    ax_mem.set_ylabel("max per-rank param bytes / ideal")
    ax_mem.set_title("Parameter memory per rank")
    ax_mem.legend(fontsize=8, loc="upper center", ncol=2)

    series = [
        ("builtin", "forward_ratio", "built-in plan: forward", "#55a868", None),
        ("builtin", "forward_backward_ratio", "built-in plan: forward + backward", "#c44e52", None),
        (
            "prepare_input_dtensor",
            "forward_backward_ratio",
            "variant use_local_output=False: fwd + bwd",
            "#8172b2",
            "//",
        ),
    ]
    width = 0.26
    for i, (plan, key, label, color, hatch) in enumerate(series):
        xs = [j + (i - 1) * width for j in range(len(tps))]
        values = [result["tp"][t]["comm"]["plans"][plan][key] for t in tps]
        bars = ax_comm.bar(xs, values, width=width, color=color, hatch=hatch, label=label)
        ax_comm.bar_label(bars, [f"{v:.2f}" for v in values], fontsize=8)
    ax_comm.axhline(1.0, color="black", linestyle="--", label="Megatron-SP theory (target 1.00)")
    ax_comm.set_xticks(range(len(tps)), [f"TP {t}" for t in tps])
    ax_comm.set_ylabel("measured / theory bytes sent per rank")
    ax_comm.set_title(f"Communication per decoder layer (S={SEQ_LEN}, fp32, ring convention)")
    top = max(result["tp"][t]["comm"]["plans"][p][k] for t in tps for p, k, *_ in series)
    ax_comm.set_ylim(0, max(top, 1.0) * 1.45)
    ax_comm.legend(fontsize=7, loc="upper left")
    fig.suptitle("Tensor + sequence parallelism, Qwen3 hidden 1024, 2 layers")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    import torch

    from shardforge.mesh.testing.pool import get_rank_pool

    started = time.perf_counter()
    info = _common.machine_info()
    torch.set_num_threads(info["cores"])
    reference = _build(MODEL["num_hidden_layers"])
    unsharded_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    element_size = next(reference.parameters()).element_size()
    input_ids, position_ids = _batch()
    with torch.no_grad():
        ref_logits = reference(input_ids=input_ids, position_ids=position_ids).logits
    del reference
    print(f"[{NAME}] unsharded: {unsharded_bytes / 2**20:.2f} MiB of parameters", flush=True)

    tps: dict[str, Any] = {}
    for tp in TPS:
        runs = {plan: get_rank_pool(tp).run(measure_rank, plan, timeout_s=600) for plan in PLANS}
        get_rank_pool(tp).close()
        per_rank_mem = [r["memory"] for r in runs["builtin"]]
        ideal = unsharded_bytes / tp
        max_local = max(m["local_bytes"] for m in per_rank_mem)
        if any(m["global_bytes"] != unsharded_bytes for m in per_rank_mem):
            raise RuntimeError("the sharded model's global parameter bytes differ from the unsharded model's")
        memory = {
            "per_rank_local_bytes": [m["local_bytes"] for m in per_rank_mem],
            "unsharded_bytes": unsharded_bytes,
            "ideal_bytes": ideal,
            "max_local_bytes": max_local,
            "ratio": max_local / ideal,
            "replicated_bytes_per_rank": per_rank_mem[0]["replicated_bytes"],
            "replicated_params": per_rank_mem[0]["replicated_params"],
            "sharded_local_bytes_per_rank": [m["sharded_local_bytes"] for m in per_rank_mem],
            "met": max_local / ideal <= MEMORY_TARGET,
        }
        th = theory(tp, MODEL["hidden_size"], element_size)
        plans: dict[str, Any] = {}
        for plan, per_rank in runs.items():
            layer = _per_layer(per_rank)
            layer["forward_ratio"] = layer["forward_sent_bytes"] / th["forward_sent_bytes"]
            layer["forward_backward_ratio"] = layer["forward_backward_sent_bytes"] / th["forward_backward_sent_bytes"]
            layer["forward_backward_payload_ratio"] = (
                layer["forward_backward_payload_bytes"] / th["forward_backward_payload_bytes"]
            )
            layer["logits_max_abs_diff_vs_unsharded"] = (per_rank[0]["logits"] - ref_logits).abs().max().item()
            layer["trace_seconds_max_over_ranks"] = max(r["trace_seconds_2_layers"] for r in per_rank)
            layer["layer0_collectives_rank0"] = _layer_records(per_rank)
            plans[plan] = layer
        ours = plans["builtin"]
        comm = {
            "theory": th,
            "plans": plans,
            "met": _in_tolerance(ours["forward_ratio"]) and _in_tolerance(ours["forward_backward_ratio"]),
        }
        tps[str(tp)] = {"memory": memory, "comm": comm}
        mib = 2**20
        print(
            f"[{NAME}] TP {tp} memory: max per-rank {max_local / mib:.3f} MiB vs ideal {ideal / mib:.3f} MiB -> "
            f"ratio {memory['ratio']:.5f}; replicated (norms) {memory['replicated_bytes_per_rank'] / 1024:.1f} KiB "
            f"per rank in {len(memory['replicated_params'])} params",
            flush=True,
        )
        for plan, layer in plans.items():
            by = layer["by_phase"]
            print(
                f"[{NAME}] TP {tp} comm/layer [{plan}]: fwd {layer['forward_sent_bytes'] / mib:.3f} MiB "
                f"(theory {th['forward_sent_bytes'] / mib:.3f}, ratio {layer['forward_ratio']:.3f}) {by['forward']['counts']}; "
                f"fwd+bwd {layer['forward_backward_sent_bytes'] / mib:.3f} MiB "
                f"(theory {th['forward_backward_sent_bytes'] / mib:.3f}, ratio {layer['forward_backward_ratio']:.3f}) "
                f"bwd {by['backward']['counts']}; deferred norm-grad sync "
                f"{layer['deferred_norm_grad_sync_sent_bytes'] / 1024:.1f} KiB {by['grad_sync']['counts']}; "
                f"module attribution agrees: {layer['attribution_agrees_with_difference']}; "
                f"logits max |diff| vs unsharded {layer['logits_max_abs_diff_vs_unsharded']:.2e}",
                flush=True,
            )
        for plan, layer in plans.items():
            if layer["logits_max_abs_diff_vs_unsharded"] > 1e-3:
                raise RuntimeError(f"TP {tp} [{plan}]: logits differ from the unsharded model's; numbers meaningless")

    result = {
        "benchmark": NAME,
        "description": (
            "TP+SP on Qwen3 (hidden 1024, 2 layers): max per-rank parameter bytes / (unsharded / tp); "
            "bytes sent per rank per decoder layer (ring convention) / Megatron-SP theory"
        ),
        "byte_convention": (
            "bytes each rank sends with a ring algorithm: all-gather of output B and reduce-scatter of input B "
            "send B*(tp-1)/tp, all-reduce of B sends 2*B*(tp-1)/tp; payload_bytes = B"
        ),
        "theory": "per layer: forward 2 all-gathers + 2 reduce-scatters of [S, hidden]; backward the same (conjugates)",
        "targets": {
            "memory_max_ratio": MEMORY_TARGET,
            "comm_ratio": COMM_TARGET,
            "comm_tolerance": COMM_TOLERANCE,
        },
        "plans": PLANS,
        "model": MODEL,
        "seq_len": SEQ_LEN,
        "dtype": str(ref_logits.dtype),
        "attn_implementation": "sdpa",
        "tp": tps,
        "machine": info,
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    json_path = _common.write_json(NAME, result)
    png = _common.png_path(NAME)
    plot(result, png)
    machine = _common.machine_label(info)
    for tp, entry in tps.items():
        memory = entry["memory"]
        _common.upsert_result_row(
            benchmark=f"tp_memory (TP {tp})",
            metric="max per-rank MiB of parameters (local shards), Qwen3 hidden 1024, 2 layers, TP+SP",
            ours=f"{memory['max_local_bytes'] / 2**20:.3f}",
            baseline=f"{memory['ideal_bytes'] / 2**20:.3f} (unsharded / {tp})",
            ratio=f"{memory['ratio']:.4f}",
            target=_common.target_cell(f"<= {MEMORY_TARGET:.2f}", memory["met"]),
            machine=machine,
        )
        comm = entry["comm"]
        ours = comm["plans"]["builtin"]
        th = comm["theory"]
        _common.upsert_result_row(
            benchmark=f"tp_comm (TP {tp})",
            metric=f"MiB sent per rank per decoder layer, fwd+bwd [fwd], ring convention, S={SEQ_LEN} fp32",
            ours=f"{ours['forward_backward_sent_bytes'] / 2**20:.3f} [fwd {ours['forward_sent_bytes'] / 2**20:.3f}]",
            baseline=(
                f"{th['forward_backward_sent_bytes'] / 2**20:.3f} [fwd {th['forward_sent_bytes'] / 2**20:.3f}] "
                "(Megatron-SP theory)"
            ),
            ratio=f"{ours['forward_backward_ratio']:.2f} [fwd {ours['forward_ratio']:.2f}]",
            target=_common.target_cell(f"{COMM_TARGET:.2f} +- {COMM_TOLERANCE:.2f}", comm["met"]),
            machine=machine,
        )
    print(f"[{NAME}] wrote {json_path}, {png} and two rows per TP size in {_common.RESULTS_MD}", flush=True)
    print(f"[{NAME}] done in {result['seconds']:.0f} s", flush=True)
    missed = [f"memory TP {t}" for t, e in tps.items() if not e["memory"]["met"]]
    missed += [f"comm TP {t}" for t, e in tps.items() if not e["comm"]["met"]]
    if missed:
        print(f"[{NAME}] TARGET MISSED: {', '.join(missed)}", flush=True)
    return 1 if missed and "--strict" in sys.argv[1:] else 0


if __name__ == "__main__":
    sys.exit(main())
