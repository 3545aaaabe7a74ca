"""Shared fixtures of the CUDA suite (`nox -s gpu`, `bash benchmarks/gpu/run.sh tests`).

Every module skips without a CUDA device ("no CUDA device"). ``SHARDFORGE_GPU_TESTS_ON_CPU=1`` runs
the tests on the CPU instead (gloo, fp32 where the CPU lacks a kernel) so their code can be checked on a
machine without a GPU before GPU minutes are spent on it; assertions about CUDA placement or kernels
are skipped there (they say so).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ON_CPU = os.environ.get("SHARDFORGE_GPU_TESTS_ON_CPU") == "1"
"""Dry run of the suite's code on the CPU (no CUDA assertions)."""


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's variables from an outer launcher would make the engine expect more ranks.
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda:0 (or the CPU in a dry run)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


@pytest.fixture(scope="session")
def world1() -> Iterator[str]:
    """A 1-rank default process group (NCCL on CUDA, gloo in a dry run); yields the backend.

    The engine then builds a mesh, its scalar statistics go through real NCCL all-reduces (CUDA
    tensors only), and the trainers' collectives can be recorded per device.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        yield str(dist.get_backend())
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Char tokenizer + tiny Qwen3 (save_pretrained) + addition JSONL, built once."""
    from shardforge.algorithms.testing import tiny_assets

    root: Path = tmp_path_factory.mktemp("gpu_assets")
    return tiny_assets(root, seed=11, hidden=64, layers=2, max_operand=20, num_eval=8, data_seed=2)
