"""JSON over HTTP with the standard library only (``urllib``): what the trainer needs to talk to a vLLM server.

The trainer's environment does not need vLLM or an HTTP client library (`shardforge.rollout.vllm.server`).
A server's error reply becomes a `ServerErrorReply` (a ``RuntimeError``) naming the route and status; a dead, hung or unreachable server
raises what ``urllib`` raises (`shardforge.rollout.server.health.REQUEST_FAILURES`).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

__all__ = ["ServerErrorReply", "get_json", "local_address_towards", "post_json"]


class ServerErrorReply(RuntimeError):
    """The server answered with an HTTP error status (it is alive and refused the request)."""


def _request(url: str, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            payload = reply.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise ServerErrorReply(f"vLLM server {path} failed with HTTP {exc.code}: {detail}") from exc
    return json.loads(payload) if payload else {}  # type: ignore[no-any-return]


def post_json(url: str, path: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """POST ``body`` to ``url + path``; the JSON reply ({} when empty). ``timeout``: per socket operation."""
    return _request(url, path, body, timeout)


def get_json(url: str, path: str, timeout: float = 600.0) -> dict[str, Any]:
    """GET ``url + path``; the JSON reply."""
    return _request(url, path, None, timeout)


def local_address_towards(url: str) -> str:
    """This host's address on the interface that routes to ``url``'s host (loopback for a local server): where
    that server reaches this host back."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP: nothing is sent, the kernel only picks the route
            return str(probe.getsockname()[0])
    except OSError:  # no IPv4 route: the name other hosts resolve
        return socket.gethostname()
