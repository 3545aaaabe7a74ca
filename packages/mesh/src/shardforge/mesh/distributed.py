"""Process-group start-up: NCCL when CUDA is present, gloo otherwise."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["current_device", "default_device_type", "destroy_distributed", "init_distributed"]


def default_device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def current_device() -> torch.device:
    """The device this rank computes on (its local GPU, or the CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[int, int]:
    """Initialise the default process group from torchrun-style env vars; return (rank, world_size).

    A no-op (returning the current values) when already initialised. With no ``WORLD_SIZE``
    in the environment this starts a single-process group so the same code runs without
    torchrun. ``timeout_s`` turns a hang in a collective into an error.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"world_size={world_size} but {missing} are not set; launch with torchrun "
            "(e.g. `torchrun --nproc-per-node 2 ...`) or set MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank % max(torch.cuda.device_count(), 1))))
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return rank, world_size


def destroy_distributed() -> None:
    """Tear down the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
