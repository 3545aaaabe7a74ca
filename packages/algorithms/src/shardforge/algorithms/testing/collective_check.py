"""A debug recorder of torch.distributed collectives: who issued which op with tensors on which device.

While a `CollectiveRecorder` is active, the tensor collectives (``all_reduce``, ``broadcast``,
``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``,
``all_to_all``, ``all_to_all_single``, ``send``/``recv`` ...) and the object collectives of
``torch.distributed`` are wrapped; each outermost call is recorded as a `CollectiveCall` (op, the
devices of its tensors, the group's backend, the calling ``file:line``, and for calls made by
`shardforge.mesh.collectives` the ``device=`` its caller passed) and then runs.

`CollectiveRecorder.problems` applies three rules:

1. code above the engine (algorithms, rollout, rewards) and the engine's ``batching/`` issue no raw tensor
   collective: only `shardforge.mesh.collectives` and the rest of the engine do (object collectives, which pick
   their device themselves, are allowed);
2. every tensor is on the device type the backend needs (NCCL: ``cuda``; gloo: ``cpu``);
3. every helper call from code above the engine (trainers, rollout, ...) passed
   ``device=`` and, given ``expected_device``, the engine's device (``batching/`` itself and the
   engine may rely on the helper's default, the backend's device).

On a CUDA run (NCCL) rule 2 flags a CPU tensor handed to a collective at its call site (NCCL
itself would raise deep inside, or hang the other ranks). On CPU (gloo) every tensor is on the CPU,
so rules 1 and 3 carry the check: no hand-written collective can build its tensor on the wrong
device, and every helper call is told the engine's device (a forgotten ``device=`` is flagged on
CPU although it would only fail on an accelerator).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import shardforge.algorithms
import shardforge.engine
import shardforge.rewards
import shardforge.rollout
from shardforge.mesh import collectives as mesh_collectives

__all__ = ["OBJECT_OPS", "TENSOR_OPS", "CollectiveCall", "CollectiveRecorder"]

TENSOR_OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
"""Wrapped tensor collectives."""
OBJECT_OPS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
"""Wrapped object collectives (torch moves the pickled bytes to the backend's device itself)."""
BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}
"""The device type each backend needs its tensors on."""

_HELPER = Path(mesh_collectives.__file__).resolve()
_ENGINE = Path(shardforge.engine.__file__).resolve().parent
_ABOVE_ENGINE = tuple(
    Path(str(module.__file__)).resolve().parent
    for module in (shardforge.algorithms, shardforge.rollout, shardforge.rewards)  # type: ignore[attr-defined]
)
"""Code above the engine: it must call the helper with the engine's device and never issue raw collectives."""
_THIS = Path(__file__).resolve()
_TORCH = Path(torch.__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One recorded collective."""

    op: str
    devices: tuple[str, ...]
    """Device of every tensor argument (e.g. "cpu", "cuda:0")."""
    backend: str
    site: str
    """``file:line`` that called ``torch.distributed.<op>`` (the first frame outside torch)."""
    origin: str
    """"helper" (shardforge/mesh/collectives.py), "batching" (shardforge/engine/batching), "engine" (the rest of
    shardforge.engine), "algorithms" (shardforge.algorithms, .rollout, .rewards: code above the engine) or
    "other"."""
    caller: str = ""
    """For helper calls: the ``file:line`` that called the helper."""
    caller_origin: str = ""
    """For helper calls: the origin (as above) of ``caller``."""
    helper_device: str | None = None
    """For helper calls: the ``device=`` its caller passed (None: not passed)."""


def _origin(path: Path) -> str:
    if path == _HELPER:
        return "helper"
    if path.is_relative_to(_ENGINE):
        return "batching" if path.relative_to(_ENGINE).parts[0] == "batching" else "engine"
    if any(path.is_relative_to(root) for root in _ABOVE_ENGINE):
        return "algorithms"
    return "other"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _outside(frame: FrameType | None) -> FrameType | None:
    """The first frame outside torch and this module."""
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path != _THIS and not path.is_relative_to(_TORCH):
            return frame
        frame = frame.f_back
    return None


def _where(frame: FrameType | None) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


class CollectiveRecorder:
    """Context manager: records `calls` of every rank-local collective while active (not reentrant)."""

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []
        self._local = threading.local()

    def __enter__(self) -> CollectiveRecorder:
        for name in (*TENSOR_OPS, *OBJECT_OPS):
            original: Callable[..., Any] | None = getattr(c10d, name, None)
            if original is None:
                continue
            target: Callable[..., Any] = original
            wrapped = self._wrap(name, target)
            for module in (dist, c10d):
                if getattr(module, name, None) is target:
                    self._saved.append((module, name, target))
                    setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:  # the outermost call only (object collectives call tensor ones inside)
                self._record(name, args, kwargs, sys._getframe(1))
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], frame: FrameType) -> None:
        try:
            backend = str(dist.get_backend(kwargs.get("group")))
        except (RuntimeError, ValueError):
            backend = "?"
        site_frame = _outside(frame)
        path = Path(site_frame.f_code.co_filename).resolve() if site_frame is not None else Path("?")
        origin = _origin(path)
        caller, caller_origin, helper_device = "", "", None
        if origin == "helper" and site_frame is not None:
            device = site_frame.f_locals.get("device")
            helper_device = None if device is None else str(device)
            outer = site_frame.f_back
            while outer is not None and Path(outer.f_code.co_filename).resolve() == _HELPER:
                outer = outer.f_back
            caller = _where(outer)
            caller_origin = _origin(Path(outer.f_code.co_filename).resolve()) if outer is not None else "?"
        devices = tuple(str(t.device) for t in (*_tensors(args), *_tensors(list(kwargs.values()))))
        self.calls.append(
            CollectiveCall(
                op=name,
                devices=devices if name not in OBJECT_OPS else (),
                backend=backend,
                site=_where(site_frame),
                origin=origin,
                caller=caller,
                caller_origin=caller_origin,
                helper_device=helper_device,
            )
        )

    def problems(self, expected_device: torch.device | str | None = None) -> list[str]:
        """Every broken rule (see the module docstring), one line each; [] when all hold."""
        found = []
        expected = None if expected_device is None else str(torch.device(expected_device))
        for call in self.calls:
            if call.origin in ("algorithms", "batching") and call.op not in OBJECT_OPS:
                found.append(f"raw {call.op} at {call.site}: use shardforge.mesh.collectives")
            need = BACKEND_DEVICE.get(call.backend)
            wrong = [d for d in call.devices if need is not None and torch.device(d).type != need]
            if wrong:
                found.append(f"{call.op} at {call.site} ({call.caller or 'direct'}): {wrong} on {call.backend}")
            if call.origin == "helper" and call.caller_origin in ("algorithms", "other"):
                if call.helper_device is None:
                    found.append(f"{call.op} helper called without device= at {call.caller}")
                elif expected is not None and call.helper_device != expected:
                    found.append(f"{call.op} helper got device={call.helper_device} != {expected} at {call.caller}")
        return found
