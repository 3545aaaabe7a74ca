"""`init_distributed` / `destroy_distributed` in this process (single rank) and the device helpers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh import (
    ParallelDims,
    build_mesh,
    current_device,
    default_device_type,
    destroy_distributed,
    init_distributed,
)

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU/gloo path")


@pytest.fixture
def clean_env(monkeypatch):
    """No torchrun variables; whatever init_distributed sets is undone afterwards."""
    assert not dist.is_initialized()
    for key in ENV_KEYS:
        monkeypatch.setenv(key, "placeholder")  # records the original value (or its absence) for teardown
        monkeypatch.delenv(key)
    yield monkeypatch
    destroy_distributed()


@cpu_only
def test_single_process_without_torchrun(clean_env):
    import os

    assert init_distributed(timeout_s=30) == (0, 1)
    assert dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert int(os.environ["MASTER_PORT"]) > 0
    # already initialised: a no-op, even with arguments that would otherwise fail
    assert init_distributed(backend="no-such-backend", world_size=8) == (0, 1)
    mesh = build_mesh(ParallelDims())
    assert mesh.world.mesh.tolist() == [0]
    assert mesh.device_type == "cpu"
    assert not mesh.has("dp_shard") and mesh.size("world_size") == 1
    destroy_distributed()
    assert not dist.is_initialized()
    destroy_distributed()  # idempotent


def test_multi_rank_without_master_address_explains_torchrun(clean_env):
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        RuntimeError, match=r"world_size=2 but \['MASTER_ADDR', 'MASTER_PORT'\] are not set; launch with torchrun"
    ):
        init_distributed()
    assert not dist.is_initialized()


def test_missing_port_only_is_named(clean_env):
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(RuntimeError, match=r"world_size=4 but \['MASTER_PORT'\] are not set"):
        init_distributed(rank=1, world_size=4)
    assert not dist.is_initialized()


@cpu_only
def test_explicit_rank_and_world_override_the_environment(clean_env):
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "1")
    assert init_distributed(rank=0, world_size=1, timeout_s=30) == (0, 1)
    assert dist.get_world_size() == 1


@cpu_only
def test_device_helpers_on_cpu():
    assert default_device_type() == "cpu"
    assert current_device() == torch.device("cpu")


def test_free_port_is_bindable_and_outside_the_kernels_ephemeral_range() -> None:
    import socket

    from shardforge.mesh import free_port
    from shardforge.mesh.distributed import _ephemeral_low

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(max(1024, low - 16384) <= port < low for port in ports), (low, ports)
    assert len(ports) > 1  # random, not one fixed port two parallel callers would both get
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))
