"""Tokens/s and MFU of SFT steps at world 1 on ~1B and ~3B Llama shapes (H100, bf16, packed).

Usage (GPU machine): ``python3 benchmarks/gpu/bench_mfu.py [--models 1b,3b] [--seqs 4096,8192]
[--ac none,selective,full] [--compile off,on] [--steps 6] [--budget-s 420]``. Without CUDA it prints
"no CUDA device" and exits 0.

What runs: `TrainEngine` ("d-1", one process) on a randomly initialised Llama (Llama 3.2 1B / 3B
dimensions, untied 128k vocabulary so the count matches torchtitan's llama3), bf16 parameters with
AnyPrecisionAdamW (bf16 moments + Kahan: the world-1 setting that fits 3B on one GPU; at world 1
the engine builds no FSDP wrapper, so there is no separate compute dtype), one packed micro-batch
of ``seq`` tokens per step made of documents of mixed lengths, activation checkpointing none /
selective (every 2nd layer) / full, and optionally ``torch.compile`` per decoder layer.

FLOPs per step (stated, as torchtitan counts them):
    6 * N * T  +  12 * l * h * q * s * T     (torchtitan: N = parameters without the input
                                               embedding, l layers, h heads, q head dim, s = seq)
and the packed-causal attention actually computed: 6 * N * T + 6 * l * h * q * sum(L_i^2).
MFU = FLOPs / step time / peak; the peak is the H100 bf16 dense spec (989 TFLOP/s) and, beside it,
the 8192^3 matmul measured in the same run (~798 TFLOP/s in the device notes).

torchtitan anchor: when ``import torchtitan`` works (carry its wheel, docs/gpu.md), its llama3
``Transformer`` with the same dimensions and tokens runs a plain bf16 AdamW loop (model kernels
only, no trainer) and ours/torchtitan is reported; else "torchtitan not installed: anchor skipped".
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _gpu_common import (
    H100_BF16_DENSE_PEAK,
    H100_BF16_MEASURED,
    device_info,
    device_label,
    free_cuda,
    import_packages,
    matmul_peak,
    require_cuda,
    result_row,
    write_json,
)

SHAPES = {
    # Llama 3.2 1B / 3B dimensions (untied output, as torchtitan's llama3).
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192},
    "3b": {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
           "intermediate_size": 8192},
}  # fmt: skip
VOCAB = 128256


def llama_config(shape: str, seq: int) -> Any:
    from transformers import LlamaConfig

    dims = SHAPES[shape]
    return LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=max(seq, 8192), rope_theta=500000.0, tie_word_embeddings=False,
        head_dim=dims["hidden_size"] // dims["num_attention_heads"], **dims,
    )  # fmt: skip


def document_lengths(seq: int, seed: int = 0) -> list[int]:
    """Mixed document lengths (seq/16 .. seq/2) that fill exactly ``seq`` tokens."""
    import random

    rng, lengths, left = random.Random(seed), [], seq
    while left > 0:
        n = min(left, rng.randint(seq // 16, seq // 2))
        lengths.append(n)
        left -= n
    return lengths


def flops_per_step(cfg: Any, n_params: int, lengths: list[int]) -> dict[str, float]:
    tokens, seq = sum(lengths), sum(lengths)
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    head_dim = cfg.hidden_size // heads
    dense = 6 * n_params * tokens
    return {
        "titan": dense + 12 * layers * heads * head_dim * seq * tokens,
        "packed_causal": dense + 6 * layers * heads * head_dim * sum(n * n for n in lengths),
    }


def save_model(shape: str, seq: int, root: str) -> str:
    """Random init on the GPU (fast), saved once per shape so each engine build only loads it."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    path = f"{root}/{shape}"
    if not os.path.isdir(path):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(llama_config(shape, seq), dtype=torch.bfloat16)
        model.save_pretrained(path)
        del model
        free_cuda()
    return path


def run_ours(path: str, shape: str, seq: int, ac: str, compile_: bool, steps: int) -> dict[str, Any]:
    import torch

    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences

    gen = torch.Generator().manual_seed(0)
    lengths = document_lengths(seq)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    batch = pack_sequences(seqs, [[1.0] * n for n in lengths])
    config = EngineConfig(
        param_dtype="bfloat16", optimizer=OptimizerConfig(name="anyprecision_adamw", lr=1e-5),
        max_tokens_per_microbatch=seq, activation_checkpointing=ac, checkpoint_every=2,
    )  # fmt: skip
    engine = TrainEngine(path, "d-1", config)
    n_params = sum(p.numel() for n, p in engine.model.named_parameters() if "embed_tokens" not in n)
    if compile_:
        for layer in engine.model.model.layers:
            layer.compile()
    started = time.perf_counter()
    engine.train_batch(batch)  # warm-up (and compilation)
    engine.train_batch(batch)
    warmup_s = time.perf_counter() - started
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        stats = engine.train_batch(batch)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    flops = flops_per_step(engine.hf_config, n_params, lengths)
    result = {
        "model": shape, "seq": seq, "ac": ac, "compile": compile_, "params_non_embedding": n_params,
        "documents": len(lengths), "step_s": step_s, "tokens_per_s": seq / step_s, "warmup_s": warmup_s,
        "tflops_titan": flops["titan"] / step_s / 1e12, "tflops_packed": flops["packed_causal"] / step_s / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": stats["loss"],
    }  # fmt: skip
    del engine
    free_cuda()
    return result


def run_torchtitan(shape: str, lengths: list[int], steps: int) -> dict[str, Any] | str:
    """The same dims and packed documents through torchtitan's llama3 model; or why not.

    torchtitan's own llama3 model with its varlen attention over the same documents (block-causal,
    as ours), untied output, bf16 parameters and fused AdamW in a plain loop (model kernels only, no
    trainer). Two APIs: 0.2.x (``TransformerModelArgs``, document ends marked by an EOS id: works
    with torch 2.11) and 0.3 (``llama3_configs``; needs a newer torch than 2.11).
    """
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        return "torchtitan not installed: anchor skipped"
    errors = []
    for backend in ("varlen", "flex"):
        try:
            return _titan_steps(shape, lengths, steps, backend)
        except Exception as err:  # an API drift in torchtitan must not lose the rest of the run
            free_cuda()
            errors.append(f"{backend}: {type(err).__name__}: {str(err)[:300]}")
    return "torchtitan anchor failed: " + " | ".join(errors)


def _titan_model(shape: str, lengths: list[int], backend: str) -> tuple[Any, Any]:
    """(model on CUDA in bf16, forward(ids) -> logits) for torchtitan 0.2.x or 0.3."""
    import types

    import torch
    import torchtitan.models.llama3 as titan  # type: ignore[import-not-found]

    dims = SHAPES[shape]
    if hasattr(titan, "TransformerModelArgs"):  # 0.2.x
        eos = VOCAB - 1
        args = titan.TransformerModelArgs(
            dim=dims["hidden_size"], n_layers=dims["num_hidden_layers"], n_heads=dims["num_attention_heads"],
            n_kv_heads=dims["num_key_value_heads"], vocab_size=VOCAB, multiple_of=1024,
            ffn_dim_multiplier=1.5 if shape == "1b" else 1.0, rope_theta=500000.0, max_seq_len=sum(lengths),
            attn_type=backend, attn_mask_type="block_causal", eos_id=eos,
        )  # fmt: skip
        with torch.device("cuda"):
            model = titan.Transformer(args)
        with torch.no_grad():  # as titan's trainer calls it (its init copies into leaf parameters)
            model.init_weights(buffer_device=torch.device("cuda"))
        model = model.to(torch.bfloat16)
        tokenizer = types.SimpleNamespace(eos_id=eos)

        def forward(ids: Any) -> Any:
            ids = ids.clone()
            ends = torch.tensor(lengths, device=ids.device).cumsum(0) - 1
            ids[0, ends] = eos  # document ends, as titan's block-causal masks read them
            return model(ids, model.get_attention_masks(ids, tokenizer))

        return model, forward
    cfg = titan.llama3_configs[shape.upper()](attn_backend=backend)  # 0.3
    cfg.enable_weight_tying = False
    with torch.device("cuda"):
        model = cfg.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cuda"))
    model = model.to(torch.bfloat16)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
    masks = model.get_attention_masks(positions)
    return model, lambda ids: model(ids, positions, masks)


def _titan_steps(shape: str, lengths: list[int], steps: int, backend: str) -> dict[str, Any]:
    import torch

    model, forward = _titan_model(shape, lengths, backend)
    n_params = sum(p.numel() for n, p in model.named_parameters() if "tok_embeddings" not in n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    seq = sum(lengths)
    ids = torch.randint(0, VOCAB - 1, (1, seq), device="cuda")

    def step() -> float:
        logits = forward(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    from importlib.metadata import version

    return {
        "step_s": step_s, "tokens_per_s": seq / step_s, "params_non_embedding": n_params, "loss": loss,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "version": version("torchtitan"),
        "note": f"torchtitan {version('torchtitan')} llama3 {shape.upper()}, {backend} attention over the same "
                "documents, untied, bf16 params + fused AdamW, plain loop",
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="1b,3b")
    parser.add_argument("--seqs", default="4096,8192")
    parser.add_argument("--ac", default="none,selective,full")
    parser.add_argument("--compile", default="off,on", help="off, on or off,on (on: 4096 only, AC none/full)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new configuration after this")
    parser.add_argument("--model-root", default="/tmp/shardforge_bench_mfu")
    args = parser.parse_args()
    require_cuda("bench_mfu.py")
    import_packages()
    import torch

    info = device_info()
    measured_peak = matmul_peak()
    print(f"{device_label(info)}; bf16 matmul peak now {measured_peak / 1e12:.0f} TFLOP/s")
    plan = []
    for shape in args.models.split(","):
        for seq in map(int, args.seqs.split(",")):
            for ac in args.ac.split(","):
                for comp in args.compile.split(","):
                    if comp == "on" and (seq != 4096 or ac == "selective"):
                        continue
                    plan.append((shape, seq, ac, comp == "on"))
    # Most informative first, so a short lease still measures them: no AC (with the torchtitan
    # anchor) on every shape, then full AC, selective AC, and compiled runs last.
    plan.sort(key=lambda p: (p[3], {"none": 0, "full": 1}.get(p[2], 2)))
    began, results, anchors = time.perf_counter(), [], {}
    for shape, seq, ac, comp in plan:
        if time.perf_counter() - began > args.budget_s:
            print(f"budget {args.budget_s:.0f} s spent: skipping {shape} seq {seq} ac {ac} compile {comp}")
            results.append({"model": shape, "seq": seq, "ac": ac, "compile": comp, "error": "skipped (budget)"})
            continue
        path = save_model(shape, seq, args.model_root)
        try:
            row = run_ours(path, shape, seq, ac, comp, args.steps)
        except torch.cuda.OutOfMemoryError:
            free_cuda()
            row = {"model": shape, "seq": seq, "ac": ac, "compile": comp, "error": "CUDA OOM"}
        except Exception as err:  # e.g. compile failing: record it, keep measuring the rest
            free_cuda()
            row = {"model": shape, "seq": seq, "ac": ac, "compile": comp, "error": f"{type(err).__name__}: {err}"}
        if "error" not in row:
            row["mfu_spec"] = row["tflops_titan"] * 1e12 / H100_BF16_DENSE_PEAK
            row["mfu_measured_peak"] = row["tflops_titan"] * 1e12 / measured_peak
        results.append(row)
        print(row, flush=True)
        if ac == "none" and not comp and (shape, seq) not in anchors:
            anchors[(shape, seq)] = run_torchtitan(shape, document_lengths(seq), args.steps)
            free_cuda()
            print("anchor", shape, seq, anchors[(shape, seq)], flush=True)
    write_json("bench_mfu", {
        "device": info, "peak_spec_flops": H100_BF16_DENSE_PEAK, "peak_notes_flops": H100_BF16_MEASURED,
        "peak_measured_flops": measured_peak, "flops_formula": "6*N*T + 12*l*h*q*s*T (torchtitan)",
        "results": results, "torchtitan": {f"{k[0]}_{k[1]}": v for k, v in anchors.items()},
    })  # fmt: skip
    print(f"\n{'model':5} {'seq':>5} {'ac':9} {'compile':7} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:5} {r['seq']:>5} {r['ac']:9} {r['compile']!s:7} {r['error']}")
            continue
        print(f"{r['model']:5} {r['seq']:>5} {r['ac']:9} {r['compile']!s:7} {r['tokens_per_s']:>9.0f} "
              f"{r['tflops_titan']:>8.1f} {r['mfu_spec']:>6.1%} {r['peak_mem_gib']:>8.1f}")  # fmt: skip
        anchor = anchors.get((r["model"], r["seq"]))
        titan = f"{anchor['tokens_per_s']:.0f}" if isinstance(anchor, dict) else (anchor or "-")
        ratio = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}" if isinstance(anchor, dict) else "-"
        result_row(
            benchmark=f"gpu_mfu ({r['model']}, seq {r['seq']}, ac {r['ac']}, compile {'on' if r['compile'] else 'off'})",
            metric="SFT tokens/s at world 1, bf16 params + AnyPrecisionAdamW, packed mixed-length docs "
                   f"[TFLOP/s by 6N+12lhqs; MFU vs 989 spec / {measured_peak / 1e12:.0f} measured]",
            ours=f"{r['tokens_per_s']:.0f} [{r['tflops_titan']:.0f} TFLOP/s; MFU {r['mfu_spec']:.1%} / "
                 f"{r['mfu_measured_peak']:.1%}]",
            baseline=f"torchtitan {titan}", ratio=ratio, target=">= 1.0 vs torchtitan; MFU 33-39% (torchtitan 8B)",
            machine=device_label(info),
        )  # fmt: skip


if __name__ == "__main__":
    main()
