"""Packed varlen attention vs padded SDPA on a batch of mixed lengths: real tokens/s (fwd + bwd).

Usage (GPU machine): ``python3 benchmarks/gpu/bench_varlen.py``; without CUDA it prints "no CUDA
device" and exits 0. Target: packed >= 1.5x padded.

The same sequences (lengths 128..8192, 64k real tokens, bf16, 32 heads, 8 kv heads, head dim 128)
go through `shardforge.ulysses_cp.packed_sdpa` (one varlen flash call over the packed tokens) and
through causal SDPA on a [B, H, Lmax, D] batch padded to the longest sequence with a key padding
mask (what an unpacked trainer runs). "Real tokens/s" counts only the unpadded tokens.
"""

from __future__ import annotations

from _gpu_common import cuda_time, device_info, device_label, import_packages, require_cuda, result_row, write_json

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def lengths(total: int = 65536, seed: int = 0) -> list[int]:
    import random

    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(int(2 ** rng.uniform(7, 13)), total - sum(out)))
    return out


def main() -> None:
    require_cuda("bench_varlen.py")
    import_packages()
    import torch
    import torch.nn.functional as F

    from shardforge.ulysses_cp import packed_sdpa

    info = device_info()
    lens = lengths()
    total, lmax, n = sum(lens), max(lens), len(lens)
    dt, dev = torch.bfloat16, torch.device("cuda")
    q = torch.randn(total, HEADS, HEAD_DIM, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)

    def packed() -> None:
        out = packed_sdpa(q, k, v, cu, max_seqlen=lmax)
        out.backward(torch.ones_like(out))

    # Padded: [B, H, Lmax, D], causal + key padding mask (boolean, True = attend).
    qp = torch.zeros(n, HEADS, lmax, HEAD_DIM, device=dev, dtype=dt)
    kp = torch.zeros(n, HEADS, lmax, HEAD_DIM, device=dev, dtype=dt)
    vp = torch.zeros(n, HEADS, lmax, HEAD_DIM, device=dev, dtype=dt)
    groups = HEADS // KV_HEADS
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        qp[i, :, : e - s] = q.detach()[s:e].transpose(0, 1)
        kp[i, :, : e - s] = k.detach()[s:e].repeat_interleave(groups, 1).transpose(0, 1)
        vp[i, :, : e - s] = v.detach()[s:e].repeat_interleave(groups, 1).transpose(0, 1)
    valid = torch.arange(lmax, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
    causal = torch.ones(lmax, lmax, device=dev, dtype=torch.bool).tril()
    mask = causal[None, None] & valid[:, None, None, :]
    for t in (qp, kp, vp):
        t.requires_grad_()

    def padded() -> None:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)
        out.backward(torch.ones_like(out))

    results = {}
    for name, fn in (("packed_varlen", packed), ("padded_sdpa", padded)):
        try:
            seconds = cuda_time(fn, warmup=2, iters=5)
            results[name] = {"s": seconds, "real_tokens_per_s": total / seconds}
        except torch.cuda.OutOfMemoryError:
            results[name] = {"error": "CUDA OOM"}
        print(name, results[name], flush=True)
    payload = {"device": info, "lengths": lens, "real_tokens": total, "padded_tokens": n * lmax, **results}
    write_json("bench_varlen", payload)
    if all("s" in r for r in results.values()):
        ours, base = results["packed_varlen"]["real_tokens_per_s"], results["padded_sdpa"]["real_tokens_per_s"]
        result_row(
            benchmark="gpu_varlen_attention",
            metric=f"real tokens/s, attention fwd+bwd, {n} seqs of 128..8192 ({total} real / {n * lmax} padded "
                   f"tokens), bf16, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}: packed varlen vs padded SDPA + mask",
            ours=f"{ours:.3g}", baseline=f"{base:.3g}", ratio=f"{ours / base:.2f}x",
            target=f">= 1.5x ({'met' if ours / base >= 1.5 else 'MISSED'})", machine=device_label(info),
        )  # fmt: skip


if __name__ == "__main__":
    main()
