"""Expert parallelism (moe-ep): expert memory per rank, all-to-all bytes per layer, grouped-matmul speed.

Model: a Qwen3-MoE config with hidden 256, 16 experts of intermediate 256, top-4 routing
(``norm_topk_prob``), 2 layers, fp32; every rank builds it from the same seed.

1. Expert-parameter memory per rank (ep 2 on 2 ranks, ep 4 on 4 ranks). After
   `apply_expert_parallel` the experts are ``Shard(0)`` DTensors; per rank we sum the local
   bytes of every ``experts.*`` parameter. Ideal = the unsharded model's expert bytes / ep.
   Headline: max over ranks / ideal (target <= 1.10).

2. All-to-all bytes per MoE layer (ep 2 and 4). One MoE block runs forward + backward on
   T = 512 tokens per rank; every `all_to_all_single` call is recorded (bytes of the tensor
   sent, the counts exchange separately). Theory per rank and direction: T x top_k x hidden x
   4 bytes (each token copy travels once to its expert's rank), x2 for dispatch + combine,
   x2 again with backward (the gradients travel back the same way). The measured number
   counts every row in the send buffer, including rows a rank keeps for its own experts
   (the theory counts them too); the JSON also gives the bytes that actually leave the rank.

3. Speed (one process, no communication). The MoE block forward + backward on T = 4096
   tokens: our `ParallelExperts` (sort by expert, `torch.nn.functional.grouped_mm`) vs the
   same HF block with ``experts_implementation="eager"`` (HF's loop over experts with
   one-hot masks and ``index_add_``), same weights and data; median of 3 after 1 warm-up.
   Target: >= 1.5x. HF's own ``grouped_mm`` implementation is timed too, for reference.

Run: ``python benchmarks/bench_moe_ep.py`` from the repo root (about 1-2 minutes on 2 cores).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

NAME = "moe_ep"
HIDDEN, EXPERTS, INTER, TOP_K = 256, 16, 256, 4
COMM_TOKENS, SPEED_TOKENS = 512, 4096
MEMORY_TARGET, SPEED_TARGET = 1.10, 1.5


def build_model(impl: str = "eager") -> Any:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=512,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=impl)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def expert_bytes(model: torch.nn.Module) -> int:
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


def measure_rank() -> dict[str, Any]:
    """On every rank of an ep = world pool: local expert bytes and all-to-all traffic of one layer."""
    import torch.distributed as dist

    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.moe_ep import apply_expert_parallel

    world = dist.get_world_size()
    mesh = build_mesh(ParallelDims(dp_shard=world, ep=world))
    model = build_model()
    apply_expert_parallel(model, mesh.get("ep"))
    records: list[dict[str, Any]] = []
    original = dist.all_to_all_single

    def recording(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        group: Any = None,
        **kw: Any,
    ) -> Any:
        rank = dist.get_rank(group)
        rows = input_split_sizes or [input.shape[0] // dist.get_world_size(group)] * dist.get_world_size(group)
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        records.append(
            {
                "kind": "counts" if input.dtype == torch.int64 else "rows",
                "bytes": input.numel() * input.element_size(),
                "bytes_to_others": sum(r for j, r in enumerate(rows) if j != rank) * row_bytes,
            }
        )
        return original(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    block = model.model.layers[0].mlp
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    x = torch.randn(1, COMM_TOKENS, HIDDEN, generator=gen, requires_grad=True)
    dist.all_to_all_single = recording  # type: ignore[assignment]
    try:
        out = block(x)
        forward = list(records)
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
    finally:
        dist.all_to_all_single = original  # type: ignore[assignment]
    rows = [r for r in records if r["kind"] == "rows"]
    fwd_rows = [r for r in forward if r["kind"] == "rows"]
    return {
        "expert_bytes": expert_bytes(model),
        "fwd_bytes": sum(r["bytes"] for r in fwd_rows),
        "fwd_bwd_bytes": sum(r["bytes"] for r in rows),
        "fwd_bwd_bytes_to_others": sum(r["bytes_to_others"] for r in rows),
        "count_exchange_bytes": sum(r["bytes"] for r in records if r["kind"] == "counts"),
        "num_all_to_all": len(records),
    }


def time_block(block: torch.nn.Module, x: torch.Tensor, repeats: int = 3) -> float:
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    times = []
    for i in range(repeats + 1):
        xi = x.detach().clone().requires_grad_()
        start = time.perf_counter()
        (block(xi) * probe).sum().backward()
        if i >= 1:
            times.append(time.perf_counter() - start)
        block.zero_grad(set_to_none=True)
    return statistics.median(times)


def speed() -> dict[str, Any]:
    from shardforge.moe_ep import apply_expert_parallel, grouped_mm_available

    eager = build_model("eager")
    hf_grouped = build_model("grouped_mm")
    ours = copy.deepcopy(eager)
    apply_expert_parallel(ours, None)
    x = torch.randn(1, SPEED_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    blocks = {
        "ours": ours.model.layers[0].mlp,
        "hf_eager": eager.model.layers[0].mlp,
        "hf_grouped_mm": hf_grouped.model.layers[0].mlp,
    }
    with torch.no_grad():
        diff = (blocks["ours"](x) - blocks["hf_eager"](x)).abs().max().item()
    seconds = {name: time_block(block, x) for name, block in blocks.items()}
    experts = ours.model.layers[0].mlp.experts
    return {
        "seconds": seconds,
        "speedup_vs_eager": seconds["hf_eager"] / seconds["ours"],
        "speedup_vs_hf_grouped_mm": seconds["hf_grouped_mm"] / seconds["ours"],
        "max_abs_diff_vs_eager": diff,
        "grouped_mm_kernel": grouped_mm_available(x[0], experts.gate_up_proj),
        "threads": torch.get_num_threads(),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    plt = _common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    eps = list(result["ep"])
    axes[0].bar(eps, [result["ep"][e]["memory_ratio"] for e in eps])
    axes[0].axhline(MEMORY_TARGET, color="red", linestyle="--", label="target")
    axes[0].set(title="expert bytes per rank / ideal", xlabel="ep")
    axes[1].bar(
        [f"ep{e} measured" for e in eps] + [f"ep{e} theory" for e in eps],
        [result["ep"][e]["fwd_bwd_mib"] for e in eps] + [result["ep"][e]["theory_fwd_bwd_mib"] for e in eps],
    )
    axes[1].set(title=f"all-to-all MiB per rank per layer (fwd+bwd, T={COMM_TOKENS})")
    s = result["speed"]["seconds"]
    axes[2].bar(list(s), [v * 1000 for v in s.values()])
    axes[2].set(title=f"MoE block fwd+bwd ms (T={SPEED_TOKENS})")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    from shardforge.mesh.testing.pool import get_rank_pool

    started = time.perf_counter()
    info = _common.machine_info()
    full_expert_bytes = expert_bytes(build_model())
    speed_result = speed()
    print(f"[{NAME}] speed: {speed_result}", flush=True)
    per_ep: dict[str, Any] = {}
    for ep in (2, 4):
        ranks = get_rank_pool(ep).run(measure_rank, timeout_s=600)
        get_rank_pool(ep).close()
        ideal = full_expert_bytes / ep
        theory_fwd = 2 * COMM_TOKENS * TOP_K * HIDDEN * 4
        entry = {
            "per_rank": ranks,
            "ideal_expert_bytes": ideal,
            "memory_ratio": max(r["expert_bytes"] for r in ranks) / ideal,
            "fwd_mib": max(r["fwd_bytes"] for r in ranks) / 2**20,
            "fwd_bwd_mib": max(r["fwd_bwd_bytes"] for r in ranks) / 2**20,
            "fwd_bwd_to_others_mib": max(r["fwd_bwd_bytes_to_others"] for r in ranks) / 2**20,
            "theory_fwd_mib": theory_fwd / 2**20,
            "theory_fwd_bwd_mib": 2 * theory_fwd / 2**20,
        }
        entry["comm_ratio"] = entry["fwd_bwd_mib"] / entry["theory_fwd_bwd_mib"]
        per_ep[str(ep)] = entry
        print(
            f"[{NAME}] ep {ep}: memory ratio {entry['memory_ratio']:.4f}, a2a fwd+bwd {entry['fwd_bwd_mib']:.3f} MiB "
            f"vs theory {entry['theory_fwd_bwd_mib']:.3f} MiB (ratio {entry['comm_ratio']:.3f})",
            flush=True,
        )
    result = {
        "benchmark": NAME,
        "ep": per_ep,
        "speed": speed_result,
        "full_expert_bytes": full_expert_bytes,
        "machine": info,
        "date": _common.today(),
        "seconds": time.perf_counter() - started,
    }
    json_path = _common.write_json(NAME, result)
    png = _common.png_path(NAME)
    plot(result, png)
    machine = _common.machine_label(info)
    for ep, entry in per_ep.items():
        _common.upsert_result_row(
            benchmark=f"moe_expert_memory (ep {ep})",
            metric=f"max per-rank MiB of expert params, Qwen3-MoE {EXPERTS} experts x (hidden {HIDDEN}, inter {INTER}), 2 layers",
            ours=f"{max(r['expert_bytes'] for r in entry['per_rank']) / 2**20:.3f}",
            baseline=f"{entry['ideal_expert_bytes'] / 2**20:.3f} (unsharded / {ep})",
            ratio=f"{entry['memory_ratio']:.4f}",
            target=_common.target_cell(f"<= {MEMORY_TARGET:.2f}", entry["memory_ratio"] <= MEMORY_TARGET),
            machine=machine,
        )
        _common.upsert_result_row(
            benchmark=f"moe_all_to_all (ep {ep})",
            metric=f"all-to-all MiB per rank per MoE layer, fwd+bwd [fwd], T={COMM_TOKENS}, top-{TOP_K}, fp32 (+ {entry['per_rank'][0]['count_exchange_bytes']} B of counts)",
            ours=f"{entry['fwd_bwd_mib']:.3f} [fwd {entry['fwd_mib']:.3f}]",
            baseline=f"{entry['theory_fwd_bwd_mib']:.3f} [fwd {entry['theory_fwd_mib']:.3f}] (T x k x H x 4 B x 2 x 2)",
            ratio=f"{entry['comm_ratio']:.3f}",
            target=_common.target_cell("1.00 +- 0.05", abs(entry["comm_ratio"] - 1) <= 0.05),
            machine=machine,
        )
    s = speed_result
    _common.upsert_result_row(
        benchmark="moe_block_speed",
        metric=f"MoE block fwd+bwd s, grouped path (ours) vs HF eager experts, T={SPEED_TOKENS}, {EXPERTS} experts, top-{TOP_K}, fp32, 1 process [HF grouped_mm]",
        ours=f"{s['seconds']['ours']:.4f}",
        baseline=f"{s['seconds']['hf_eager']:.4f} [hf grouped_mm {s['seconds']['hf_grouped_mm']:.4f}]",
        ratio=f"{s['speedup_vs_eager']:.2f}x",
        target=_common.target_cell(f">= {SPEED_TARGET:.1f}x", s["speedup_vs_eager"] >= SPEED_TARGET),
        machine=machine,
    )
    print(f"[{NAME}] wrote {json_path}, {png} and rows in {_common.RESULTS_MD}; {result['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
