"""Weight publish to disk from CUDA tensors (GB/s vs raw writes) and embedded rollout tokens/s on a GPU.

Usage (GPU machine): ``python3 benchmarks/gpu/bench_publish.py``; without CUDA it prints "no CUDA
device" and exits 0.

Publish: a `TrainEngine` ("d-1") on a ~1B Qwen3 config, bf16 weights on the GPU, ``publish_weights``
through `DiskTransport` (buckets of 256 MiB, cast to bf16) into a temporary directory, vs two raw
baselines on the same tensors: ``torch.save`` of the whole state dict (moved to the host) and
``safetensors.torch.save_file``; GB/s = bytes of the bf16 weights / wall seconds including fsync.

Rollouts: the embedded `HFRolloutEngine` (HF ``generate``, bf16, on the GPU) on the same model,
64 prompts x n=4, 128 new tokens, temperature 1 with EOS disabled: generated tokens/s.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from _gpu_common import device_info, device_label, free_cuda, import_packages, require_cuda, result_row, write_json

MODEL = {
    "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1,
}  # fmt: skip


def _fsync_dir(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())


class _Tokenizer:
    """The few attributes `HFRolloutEngine` reads (ids only; decoding is not measured)."""

    pad_token_id, eos_token_id = 0, 2

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def main() -> None:
    require_cuda("bench_publish.py")
    import_packages()
    import safetensors.torch
    import torch
    from transformers import Qwen3Config

    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.hf.engine import HFRolloutEngine
    from shardforge.weight_sync import DiskTransport

    info = device_info()
    root = Path(tempfile.mkdtemp(prefix="sf_publish_"))
    engine = TrainEngine(Qwen3Config(**MODEL), "d-1", EngineConfig(param_dtype="bfloat16"))
    nbytes = sum(p.numel() * 2 for p in engine.model.parameters())
    timings: dict[str, float] = {}
    engine.publish_weights(DiskTransport(root / "warm"), version=1, dtype="bf16")  # warm-up (page cache, allocator)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.publish_weights(DiskTransport(root / "ours"), version=1, dtype="bf16")
    _fsync_dir(root / "ours")
    timings["publish_weights"] = time.perf_counter() - start
    state = {k: v.detach() for k, v in engine.model.state_dict().items()}
    start = time.perf_counter()
    torch.save({k: v.cpu() for k, v in state.items()}, root / "raw.pt")
    _fsync_dir(root)
    timings["torch_save"] = time.perf_counter() - start
    start = time.perf_counter()
    safetensors.torch.save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(root / "raw.safetensors"))
    _fsync_dir(root)
    timings["safetensors"] = time.perf_counter() - start
    gbps = {k: nbytes / v / 1e9 for k, v in timings.items()}
    print({"bytes": nbytes, "GB/s": gbps}, flush=True)
    model_dir = root / "hf"
    engine.export_hf(model_dir)
    del engine, state
    free_cuda()

    rollout = HFRolloutEngine(model_dir, _Tokenizer(), dtype="bfloat16", device="cuda", batch_size=256)
    rollout.model.generation_config.eos_token_id = None  # every row generates max_new_tokens
    rollout.eos_id = None
    prompts = [[1, *range(3 + i % 50, 3 + i % 50 + 32)] for i in range(64)]
    params = SamplingParams(n=4, max_new_tokens=128, temperature=1.0, seed=0)
    rollout.generate(prompts[:4], SamplingParams(n=1, max_new_tokens=8, temperature=1.0, seed=0))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = rollout.generate(prompts, params)
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - start
    generated = sum(len(r.response_ids) for r in out)
    del rollout
    free_cuda()
    payload = {"device": info, "weights_bytes": nbytes, "seconds": timings, "gb_per_s": gbps,
               "rollout": {"generated_tokens": generated, "seconds": gen_s, "tokens_per_s": generated / gen_s}}  # fmt: skip
    write_json("bench_publish", payload)
    label = device_label(info)
    result_row(
        benchmark="gpu_weight_publish_disk",
        metric=f"publish GB/s from CUDA bf16 weights ({nbytes / 1e9:.2f} GB, world 1, DiskTransport, fsync) vs "
               "torch.save [safetensors.save_file] of the same tensors moved to the host",
        ours=f"{gbps['publish_weights']:.2f}", baseline=f"{gbps['torch_save']:.2f} [{gbps['safetensors']:.2f}]",
        ratio=f"{gbps['publish_weights'] / gbps['torch_save']:.2f}", target=">= 0.60 of raw", machine=label,
    )  # fmt: skip
    result_row(
        benchmark="gpu_rollout_hf_generate",
        metric="generated tokens/s, embedded HFRolloutEngine on the GPU, bf16, ~0.9B Qwen3, 64 prompts x n=4, "
               "128 new tokens",
        ours=f"{generated / gen_s:.0f}", baseline="-", ratio="-", target="measurement (vLLM comparison: nox -s vllm)",
        machine=label,
    )  # fmt: skip


if __name__ == "__main__":
    main()
