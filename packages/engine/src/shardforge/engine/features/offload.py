"""Keep an engine's model (and optimizer state) in host memory between uses.

A reference policy is used for one forward per RL step and a critic for one forward and one
update: on an accelerator their weights and Adam moments would otherwise hold device memory the
actor needs the rest of the time. ``EngineConfig.offload_when_idle`` moves them to the host after
every `forward` / `train_batch` / `eval_batch` and back before the next one (as verl's
``offload_fsdp_model_to_cpu`` / AReaL's onload-offload do). FSDP2 modules support ``module.to()``
(they reshard first and re-register the sharded parameters), so this works on sharded models.

On a CPU-only machine the device *is* the host: both moves are no-ops and cost nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch
from torch import nn

__all__ = ["OffloadState", "move_optimizer_state", "offloaded_between_calls"]

T = TypeVar("T")
P = ParamSpec("P")


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Move every tensor in ``optimizer.state`` to ``device``; return the bytes moved. Scalar
    ``step`` tensors stay where they are (torch's Adam keeps them on CPU by design)."""
    moved = 0
    non_blocking = torch.device(device).type == "cpu"
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or key == "step" or value.device == torch.device(device):
                continue
            state[key] = value.to(device, non_blocking=non_blocking)
            moved += value.numel() * value.element_size()
    return moved


class OffloadState:
    """Where an engine's weights and optimizer state live; `offload` / `onload` move them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.offloaded = False
        self._depth = 0  # nested decorated calls (export_hf -> full_state_dict) offload once, at the end

    @property
    def active(self) -> bool:
        """False on a CPU-only machine (the device is already host memory)."""
        return self.device.type != "cpu"

    def offload(self) -> None:
        """Weights, buffers and optimizer state to host memory; free the device cache."""
        if self.offloaded or not self.active:
            return
        self.model.to("cpu")
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, "cpu")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self) -> None:
        """Everything back to the compute device."""
        if not self.offloaded:
            return
        self.model.to(self.device)
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.device)
        self.offloaded = False


class _HasOffload(Protocol):
    offload_state: OffloadState | None


S = TypeVar("S", bound=_HasOffload)


def offloaded_between_calls(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """Decorate an engine method: onload before it runs and offload after it returns (or raises)
    when the engine has an `OffloadState` (``EngineConfig.offload_when_idle``)."""

    @functools.wraps(method)
    def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        state = self.offload_state
        if state is None:
            return method(self, *args, **kwargs)
        state.onload()
        state._depth += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            state._depth -= 1
            if state._depth == 0:
                state.offload()

    return wrapper
