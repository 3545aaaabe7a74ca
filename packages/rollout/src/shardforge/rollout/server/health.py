"""Health checks of a rollout server over HTTP, and the one-line error when one is down.

A dead or hung rollout server must not hang the trainer (a hang is the failure users report
most, and the hardest to read). `VLLMServerRolloutEngine` therefore gives every request a
timeout (``rollout.vllm.request_timeout_s``), asks the server's ``/health`` (within
``rollout.vllm.health_timeout_s``) before each `generate` and after any failed request, and when the
server does not answer, either

- raises `RolloutServerError`: one line naming the server, what failed, its log (when this
  trainer started it) and what to check (``rollout.vllm.on_server_failure: error``, the default), or
- restarts a server this trainer started, brings it to the current weight version and resends
  the whole batch of requests (``on_server_failure: restart``, at most
  ``rollout.vllm.max_server_restarts`` times per run). Each request is one prompt's ``n`` samples with
  its own seed, so a resent batch regenerates whole groups (none mixes samples of the dead server
  with new ones) and equals what a healthy server would have returned.

`HealthCounters` are the ``rollout_server/*`` metrics (summed over the data-parallel group). With several
ranks sharing one server, the ranks agree on restarts once per generation round
(`shardforge.rollout.server.shared_restart`).
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["REQUEST_FAILURES", "HealthCounters", "RolloutServerError", "down_message", "probe_health", "ray_get"]

REQUEST_FAILURES: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)
"""What a dead, hung or restarting server raises from ``urllib`` (refused, reset, timed out, closed);
``urllib.error.URLError`` and ``TimeoutError`` are `OSError` subclasses. HTTP errors with a status
are answers of a live server and are not in it (the engine turns them into ``RuntimeError``)."""


class RolloutServerError(RuntimeError):
    """A rollout server is down or hung; the message is one line naming it and what to check."""


def probe_health(url: str, timeout_s: float) -> str | None:
    """None when ``GET url/health`` answers 200 within ``timeout_s``, else why not (a short phrase)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as reply:
            return None if reply.status == 200 else f"/health answered HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"/health answered HTTP {exc.code}"
    except REQUEST_FAILURES as exc:
        return describe_failure("/health", exc, timeout_s)


def describe_failure(path: str, exc: BaseException, timeout_s: float) -> str:
    """``path`` and what went wrong, in a few words (a timeout reads as a hung server)."""
    reason = getattr(exc, "reason", exc)  # URLError wraps the socket error
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"{path} did not answer within {timeout_s:g} s (hung or overloaded)"
    if isinstance(reason, ConnectionRefusedError):
        return f"{path}: connection refused (nothing listens: the server is dead)"
    if isinstance(reason, ConnectionResetError):  # a server caught while exiting (seen on a loaded machine)
        return f"{path}: connection reset (the server is exiting or dead)"
    text = " ".join(str(reason).split()) or type(reason).__name__
    return f"{path} failed: {type(reason).__name__}: {text}"


def down_message(url: str, reason: str, *, launched: bool, log_path: Path | None, restarts_left: int | None) -> str:
    """The one-line error for a server that is down: which, why, and what to check or change."""
    if launched:
        check = f"check its log {log_path} (out of memory? killed?)"
        if restarts_left == 0:
            check += "; rollout.vllm.max_server_restarts is used up"
        else:
            check += " or set rollout.vllm.on_server_failure: restart"
    else:
        check = (
            "check that the server is running and reachable from this host (rollout.vllm.server_url); "
            "only a server this trainer started can be restarted"
        )
    return f"rollout server {url} is down: {reason}; {check}"


class HealthCounters:
    """Health checks, failures, restarts and resent requests since the last `pop` (thread-safe:
    an async rollout source samples on its own thread)."""

    NAMES = ("health_checks", "failures", "restarts", "resent_requests")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.NAMES, 0)
        self.total_restarts = 0
        """Restarts over the run (for ``rollout.vllm.max_server_restarts``; `pop` does not reset it)."""

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            self._counts[name] += count
            if name == "restarts":
                self.total_restarts += count

    def add_restart(self, *, in_metrics: bool = True) -> None:
        """One restart of the run. ``in_metrics=False``: it counts towards ``rollout.vllm.max_server_restarts`` only (a
        restart of a server shared by several ranks is reported by rank 0 alone, so the sum over ranks is the
        number of restarts, and every rank's run total is the same)."""
        with self._lock:
            self.total_restarts += 1
            if in_metrics:
                self._counts["restarts"] += 1

    def pop(self) -> dict[str, float]:
        """``rollout_server/<name>`` counts since the last call (the same keys every time)."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self.NAMES, 0)
        return {f"rollout_server/{k}": float(v) for k, v in counts.items()}


def ray_get(ray: Any, ref: Any, actor: str, task_error: type[Exception]) -> Any:
    """``ray.get(ref)``; a dead ``actor`` becomes a one-line `RolloutServerError`, a failed call a one-line
    ``task_error`` naming the call's own exception."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        raise RolloutServerError(f"{actor} died: {str(exc).splitlines()[0]}") from exc
    except ray.exceptions.RayTaskError as exc:
        cause = exc.as_instanceof_cause()
        raise task_error(f"{actor}: {type(cause).__name__}: {cause}") from exc
