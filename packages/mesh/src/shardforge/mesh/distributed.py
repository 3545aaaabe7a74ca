"""Process-group start-up: NCCL when CUDA is present, gloo otherwise."""

from __future__ import annotations

import datetime
import os
import random
import socket

import torch
import torch.distributed as dist

__all__ = ["current_device", "default_device_type", "destroy_distributed", "free_port", "init_distributed"]


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
        os.environ.setdefault("MASTER_PORT", str(free_port()))
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now, for a server this process starts (a store, a test server).

    Picked at random *below* the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768+
    by default), where the kernel never hands out ports for ``bind(0)`` or outgoing connections: the port a
    caller binds seconds later (after spawning the process that binds it) cannot meanwhile become some other
    process's ephemeral port, which a port from ``bind(0)`` can (seen with parallel test processes). Only a
    process that binds that exact port itself can still take it."""
    low = _ephemeral_low()
    choices = random.SystemRandom()
    for _ in range(64):
        port = choices.randrange(max(1024, low - 16384), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    return _free_port()  # the range below is crowded: the kernel's choice


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return max(int(ports.read().split()[0]), 2048)
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default low end (macOS: 49152)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
