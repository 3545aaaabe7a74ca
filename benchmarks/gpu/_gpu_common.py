"""Shared helpers of the GPU benchmarks (benchmarks/gpu/bench_*.py, run by ``bash benchmarks/gpu/run.sh``).

Each script calls `require_cuda` first: without a CUDA device it prints "no CUDA device: ... skipped"
and exits 0, so the scripts stay runnable (and are checked) on CPU machines. On a GPU, results go to
``$SHARDFORGE_GPU_OUT`` (run.sh sets it), else ``$OUT/gpu`` (the device tool's output folder), else
``benchmarks/out/gpu/``; each script writes
``<name>.json`` there and upserts its rows in ``benchmarks/RESULTS.md`` naming the GPU.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

GPU_DIR = Path(__file__).resolve().parent
ROOT = GPU_DIR.parents[1]

H100_BF16_DENSE_PEAK = 989e12
"""NVIDIA's H100 SXM bf16 dense spec (FLOP/s); MFU is reported against it (as torchtitan does)."""
H100_BF16_MEASURED = 798e12
"""An 8192^3 bf16 matmul measured on this workplace's H100 (/work/.library/device/KINDS.md)."""


def require_cuda(script: str) -> None:
    """Exit 0 with "no CUDA device" when there is none (before any heavy import)."""
    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA device: {script} skipped (run it on a GPU machine, see docs/gpu.md)")
        raise SystemExit(0)


def import_packages() -> None:
    """Make the workspace packages importable without installing them (pure Python, PEP 420)."""
    try:
        import shardforge.algorithms  # noqa: F401
    except ImportError:
        sys.path[:0] = sorted(glob.glob(str(ROOT / "packages" / "*" / "src")))
    sys.path.insert(0, str(ROOT / "benchmarks"))


def out_dir() -> Path:
    """$SHARDFORGE_GPU_OUT (set by run.sh), else $OUT/gpu (the device tool's folder), else benchmarks/out/gpu."""
    if os.environ.get("SHARDFORGE_GPU_OUT"):
        path = Path(os.environ["SHARDFORGE_GPU_OUT"])
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu"
    else:
        path = ROOT / "benchmarks" / "out" / "gpu"
    path.mkdir(parents=True, exist_ok=True)
    return path


def device_info() -> dict[str, Any]:
    import torch
    import transformers

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "sm_count": props.multi_processor_count,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }


def device_label(info: dict[str, Any]) -> str:
    return f"{info['gpu']} ({info['gpu_memory_gib']} GiB), torch {info['torch']}, CUDA {info['cuda']}"


def write_json(name: str, payload: dict[str, Any]) -> Path:
    path = out_dir() / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def result_row(**cells: str) -> None:
    """Upsert a row in benchmarks/RESULTS.md (the machine cell names the GPU)."""
    from _common import upsert_result_row

    upsert_result_row(**cells)  # type: ignore[arg-type]


def cuda_time(fn: Any, *, warmup: int, iters: int) -> float:
    """Mean seconds per call of ``fn`` after ``warmup`` calls (synchronised wall clock)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def matmul_peak(n: int = 8192, iters: int = 10) -> float:
    """Measured bf16 matmul FLOP/s on this GPU right now (the in-run peak for MFU)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = cuda_time(lambda: a @ b, warmup=3, iters=iters)
    return 2 * n**3 / seconds


def free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
